import io
import logging
import sys

import transformers

from llm.utils.logging import configure_logging


def test_logs_follow_a_replaced_stderr(monkeypatch):
    """A log call after stderr was swapped and the old one closed reaches the new stream.

    Regression: basicConfig's StreamHandler kept the stream of the moment; with transformers'
    records propagating to the root (CI=true), every later log printed a "--- Logging error ---"
    traceback into the user's error output.
    """
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging(logging.INFO)
    logging.getLogger("llm.test").info("first message")
    assert "first message" in first.getvalue()
    first.close()

    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    logging.getLogger("llm.test").info("second message")
    transformers.utils.logging.get_logger("transformers.test").info("from transformers")
    out = second.getvalue()
    assert "second message" in out and "from transformers" in out
    assert "Logging error" not in out and "Traceback" not in out
    assert out.count("from transformers") == 1  # one handler: transformers' own one is off
