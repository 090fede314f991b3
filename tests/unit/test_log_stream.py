"""The meshforge logger writes to the standard stream of the moment, not of its first use."""

from __future__ import annotations

import contextlib
import io

from meshforge.utils.log import get_logger


def test_log_lines_follow_a_redirected_stdout() -> None:
    logger = get_logger("meshforge.test_log_stream")
    first, second = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(first):
        logger.info("one")
    with contextlib.redirect_stdout(second):
        logger.info("two")
    # (a "[rankN] " prefix, when an earlier test configured the logger inside a launch, is fine)
    assert first.getvalue().endswith("one\n") and "two" not in first.getvalue()
    assert second.getvalue().endswith("two\n") and "one" not in second.getvalue()
