"""`megatron-rlcorr`'s own argument handling (cli.py): an unknown command or option exits 2, with a
"did you mean" only when a known name is close (config.did_you_mean)."""
import pytest

from megatron_rlcorr.cli import main

COMMANDS = "commands: train, score, eval, export, presets, plan, import-verl, analyze"
PLAN = ["plan", "recipes/tiny_cpu.yaml", "--nodes", "1", "--gpus-per-node", "2"]


@pytest.mark.parametrize("argv, message", [
    (["trian"], f"unknown command 'trian' (did you mean \"train\"?); {COMMANDS}\n"),
    (["import_verl"], f"unknown command 'import_verl' (did you mean \"import-verl\"?); {COMMANDS}\n"),
    (["zzqx"], f"unknown command 'zzqx'; {COMMANDS}\n"),
    ([*PLAN, "--serch"], 'unrecognized arguments: --serch (did you mean "--search"?)\n'),
    ([*PLAN, "--jsno", "--qqq"], 'unrecognized arguments: --jsno (did you mean "--json"?) --qqq\n'),
    ([*PLAN, "--qqq"], "unrecognized arguments: --qqq\n"),
    (["presets", "extra"], "unrecognized arguments: extra\n"),
], ids=["close-command", "close-command-spelling", "far-command", "close-option", "close-and-far-options",
        "far-option", "stray-word"])
def test_unknown_names_exit_2_suggesting_only_a_close_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(message), err
    assert err.count("did you mean") == message.count("did you mean")
