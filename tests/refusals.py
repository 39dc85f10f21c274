"""The entry point's refusal contract for tests: exit status 2 before any model is built."""

from megatron_ul.training import pretrain


def refusal(argv, capsys, monkeypatch) -> str:
    """pretrain.main(argv) must return 2 before setup() runs and without a traceback; returns
    what it printed to stderr."""

    def build(cfg):
        raise AssertionError("setup() ran: the model would have been built")

    monkeypatch.setattr(pretrain, "setup", build)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert pretrain.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err
