"""PRM step labels made from rollouts (``llm/run_label.py``): Math-Shepherd's Monte Carlo estimates, OmegaPRM's
binary search for the first wrong step and tree search, consensus with a judge.

``mc.py`` and ``omega.py`` are the pure algorithms over callables (no model, no torch); ``completer.py`` the models
that write solutions and completions; ``verify.py`` the verifier and the judge; ``problem.py`` one problem labelled;
``store.py`` the resumable output; ``run.py`` the run over ranks (torchrun or Ray).
"""
