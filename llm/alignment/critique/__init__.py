"""A generative PRM's training data made from step labels (``llm/run_critiques.py``): ``make.py`` (the critiques:
templates, a judge model's), ``run.py`` (the records read, written and resumed)."""
