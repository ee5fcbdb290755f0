"""logging: idempotent setup, rank prefix, file output, level validation."""

import logging

import pytest
from rich.logging import RichHandler

from megarl.utils import logging as mlogging
from megarl.utils.logging import get_logger, setup_logging


@pytest.fixture(autouse=True)
def restore_megarl_logger():
    """setup_logging changes process-wide state; put it back for other tests."""
    root = logging.getLogger("megarl")
    saved = (list(root.handlers), root.level, root.propagate)
    yield
    for handler in root.handlers:
        if handler not in saved[0]:
            handler.close()
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    root.propagate = saved[2]


def test_idempotent_handlers(tmp_path):
    root = setup_logging()
    before = len(root.handlers)
    setup_logging(log_file=str(tmp_path / "a.log"))
    setup_logging(log_file=str(tmp_path / "a.log"))
    assert len(root.handlers) == before + 1
    setup_logging()
    assert len(root.handlers) == before


def test_rank_prefix_level_and_file(tmp_path, capsys):
    log_file = tmp_path / "run.log"
    setup_logging(level="warning", rank=3, log_file=str(log_file))
    log = get_logger("trainer")
    log.info("hidden")
    log.warning("visible %d", 7)
    err = capsys.readouterr().err
    text = log_file.read_text()
    for output in (err, text):
        assert "[rank 3] WARNING megarl.trainer: visible 7" in output
        assert "hidden" not in output
    assert len(text.splitlines()) == 1


def test_no_rank_prefix_without_rank(capsys):
    setup_logging(level=logging.DEBUG)
    logging.getLogger("megarl.x").debug("msg")
    err = capsys.readouterr().err
    assert "DEBUG megarl.x: msg" in err and "rank" not in err


def test_rich_handler_on_tty(monkeypatch):
    monkeypatch.setattr(mlogging, "_stderr_is_tty", lambda: True)
    root = setup_logging(rank=1)
    assert any(isinstance(h, RichHandler) for h in root.handlers)
    monkeypatch.setattr(mlogging, "_stderr_is_tty", lambda: False)
    root = setup_logging()
    assert not any(isinstance(h, RichHandler) for h in root.handlers)


def test_bad_level():
    with pytest.raises(ValueError, match="unknown log level 'LOUD'"):
        setup_logging(level="LOUD")


def test_get_logger_names():
    assert get_logger("trainer").name == "megarl.trainer"
    assert get_logger("megarl.actor").name == "megarl.actor"
    assert get_logger("megarl").name == "megarl"
    assert get_logger("megarlx").name == "megarl.megarlx"
