"""The command line's one vocabulary (docs/cli.md, "Conventions"), over every command of `transduce`:
every option has help, every command takes --quiet, a command that writes takes --out and --force, old
spellings still work with a warning, and errors name the command's flags, not the library's parameters."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from transduce.cli import main
from transduce.cli.errors import cli_errors, command_names
from transduce.errors import InputError

# a command that writes without --out: demo's --workdir is a workspace it reuses (--retrain starts again)
WORKSPACES = {"demo"}
WRITES_NOTHING = {"inspect", "serve"}  # a report on stdout; a server's answers go to its clients


def _each_command():
    return [pytest.param(name, cmd, id=name) for name, cmd in sorted(main.commands.items())]


def _flags(command: click.Command) -> set[str]:
    return {opt for param in command.params for opt in param.opts if opt.startswith("-")}


def test_the_walk_sees_every_command():
    assert {"train", "export", "build", "decode", "parity", "bench", "inspect", "attention", "demo"} <= set(
        main.commands)


@pytest.mark.parametrize("name, command", _each_command())
def test_every_option_has_help(name, command):
    missing = [p.opts[0] for p in command.params if isinstance(p, click.Option) and not (p.help or "").strip()]
    assert not missing, f"transduce {name}: options without help text: {', '.join(missing)}"


@pytest.mark.parametrize("name, command", _each_command())
def test_every_command_takes_quiet(name, command):
    assert "--quiet" in _flags(command), f"transduce {name} has no --quiet"
    quiet = next(p for p in command.params if "--quiet" in p.opts)
    assert quiet.is_flag


@pytest.mark.parametrize("name, command", [pytest.param(n, c, id=n) for n, c in sorted(main.commands.items())])
def test_an_output_is_out_and_replaced_only_with_force(name, command):
    """--out names what a command writes, --force lets it replace an existing one; the old spellings of an
    output (--output, parity's --json FILE) are hidden, kept for one release."""
    visible = {opt for p in command.params if not getattr(p, "hidden", False) for opt in p.opts}
    assert not {"--output", "--out-dir", "--output-dir"} & visible, name
    json = next((p for p in command.params if "--json" in p.opts and not p.hidden), None)
    assert json is None or json.is_flag, f"transduce {name}: --json FILE writes a file: that is --out"
    if "--out" in visible:
        assert "--force" in visible, f"transduce {name} writes --out but has no --force"
    elif name not in WORKSPACES | WRITES_NOTHING:
        pytest.fail(f"transduce {name}: what does it write, and where?")


def test_errors_speak_in_the_commands_flags():
    """A library error names Python's parameters (its params); the command prints each as its flag: an
    option's own name, a flag's NAME=True, an argument's metavar, and the names a command gives."""

    @click.command()
    @click.argument("model_dir")
    @click.option("--min-length", default=0)
    @click.option("--truncate", is_flag=True)
    @cli_errors(names={"beam_size": "--beam"})
    def cmd(model_dir, min_length, truncate):
        raise InputError("min_length must be >= 0 (not min_lengths; beam_size 2, model_dir x, other_name)",
                         hint="pass truncate=True", params=("min_length", "beam_size", "truncate=True", "model_dir"))

    r = CliRunner().invoke(cmd, ["m"])
    assert r.exit_code == 2, r.output
    assert r.stderr == ("error: --min-length must be >= 0 (not min_lengths; --beam 2, MODEL_DIR x, other_name)\n"
                        "  hint: pass --truncate\n"), r.stderr
    err = InputError("min_length must be >= 0", params=("min_length",))
    assert str(err) == "min_length must be >= 0"  # from Python: its own names
    names = command_names(main.commands["decode"], {"beam_size": "--beam"})
    assert names["min_length"] == "--min-length" and names["truncate=True"] == "--truncate"
    assert names["max_len_b"] == "--max-len-b" and names["model_dir"] == "--model" and names["beam_size"] == "--beam"


def test_flags_are_the_librarys_parameters_and_old_spellings_still_work(tmp_path):
    """decode's, parity's, serve's and loadtest's flags for DecodingOptions, ServiceOptions and the BackendSpec are
    derived from their fields (beam_size is --beam-size); an old spelling is a hidden alias that warns; both at
    once is a usage error."""
    import dataclasses

    from transduce.runtime.decoding import DecodingOptions
    from transduce.runtime.spec import BackendSpec
    from transduce.serve.service import ServiceOptions

    def flags(command):
        return {o for p in main.commands[command].params if isinstance(p, click.Option) and not p.hidden
                for o in p.opts}

    decoding = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(DecodingOptions)}
    spec = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(BackendSpec)} - {"--verify", "--options",
                                                                                        "--model-dir"} | {"--model"}
    assert decoding | spec <= flags("decode") and {"--beam-size", "--nbest"} | spec <= flags("parity")
    service = {"--" + f.name.replace("_", "-") for f in dataclasses.fields(ServiceOptions)}
    assert service | spec - {"--model"} <= flags("serve") and "--beam-size" in flags("loadtest")
    for command in ("decode", "parity", "serve", "loadtest"):  # the old spellings work, unlisted
        shown = CliRunner().invoke(main, [command, "--help"]).output.split()
        assert "--beam" not in flags(command) and "--beam" not in shown
    missing = str(tmp_path / "nope")
    for args, old, new in ((["decode", missing, "--beam", "0"], "--beam", "--beam-size"),
                           (["decode", missing, "--batch-tokens", "0"], "--batch-tokens", "--max-batch-tokens"),
                           (["parity", missing, "--beam", "2"], "--beam", "--beam-size"),
                           (["serve", missing, "--beam", "0"], "--beam", "--default-beam-size"),
                           (["serve", missing, "--timeout", "-1"], "--timeout", "--request-timeout")):
        r = CliRunner().invoke(main, args, input="one\n")
        assert r.exit_code == 2 and r.stderr.startswith(f"warning: {old} is deprecated: use {new}\n"), (args, r.stderr)
        assert "error: " in r.stderr and "beam_size" not in r.stderr and "request_timeout" not in r.stderr
    r = CliRunner().invoke(main, ["decode", missing, "--beam", "2", "--beam-size", "3"])
    assert r.exit_code == 2 and "--beam is the deprecated spelling of --beam-size: give --beam-size alone" in r.stderr


def test_export_out_dir_as_an_argument_is_deprecated(tmp_path):
    missing = str(tmp_path / "no-model")
    r = CliRunner().invoke(main, ["export", missing, str(tmp_path / "art"), "--quiet"])
    assert r.exit_code == 2 and r.stderr.startswith("warning: OUT_DIR as an argument is deprecated: use --out\n")
    assert "does not exist" in r.stderr  # the export ran, to the model's error
    r = CliRunner().invoke(main, ["export", missing, "--out", str(tmp_path / "art"), "--quiet"])
    assert r.exit_code == 2 and r.stderr.startswith("error: ") and "does not exist" in r.stderr, r.stderr
    r = CliRunner().invoke(main, ["export", missing])
    assert r.exit_code == 2 and "Missing option '--out'" in r.stderr
    r = CliRunner().invoke(main, ["export", missing, str(tmp_path / "a"), "--out", str(tmp_path / "b")])
    assert r.exit_code == 2 and "give --out alone" in r.stderr
    assert "[OUT_DIR]" not in CliRunner().invoke(main, ["export", "--help"]).output


def test_bench_refuses_an_earlier_report_without_force(tmp_path, monkeypatch):
    from transduce.bench import harness
    from transduce.errors import TransduceError

    def ran(*args, **kwargs):
        raise TransduceError("the bench ran")

    monkeypatch.setattr(harness, "run_bench", ran)
    out = tmp_path / "bench"
    out.mkdir()
    (out / "bench.json").write_text("{}\n")
    r = CliRunner().invoke(main, ["bench", "--quick", "--out", str(out)])
    assert r.exit_code == 2 and "already holds a bench report (bench.json)" in r.stderr, r.output
    assert "pass --force" in r.stderr and "the bench ran" not in r.stderr
    r = CliRunner().invoke(main, ["bench", "--quick", "--out", str(out), "--force", "--quiet"])
    assert r.exit_code == 2 and "the bench ran" in r.stderr, r.output


def test_attention_refuses_earlier_figures_without_force(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "maps"
    out.mkdir()
    (out / "notes.txt").write_text("mine")  # other files are no figures
    missing = str(tmp_path / "no-model")
    r = CliRunner().invoke(main, ["attention", missing, "one", "--out", str(out)])
    assert r.exit_code == 2 and "already holds" not in r.stderr and "no-model" in r.stderr, r.output
    (out / "cross_layer1.png").write_bytes(b"\x89PNG")
    (out / "token_cross_layer1_pos1.png").write_bytes(b"\x89PNG")
    r = CliRunner().invoke(main, ["attention", missing, "one", "--out", str(out)])
    assert r.exit_code == 2 and "already holds attention figures (cross_layer1.png and 1 more)" in r.stderr, r.output
    r = CliRunner().invoke(main, ["attention", missing, "one", "--out", str(out), "--force", "--quiet"])
    assert r.exit_code == 2 and "already holds" not in r.stderr and "no-model" in r.stderr, r.output


def test_demo_quiet_prints_nothing(tmp_path, monkeypatch, tiny_model_dir, tiny_artifact_dir):
    """demo --quiet: none of its lines, tables or training bar; the exit status says whether parity passed."""
    from transduce.demo import pipeline

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "valid.tsv").write_text("one\tun\ntwo\tdeux\n")
    said = []
    monkeypatch.setattr(pipeline, "ensure_demo_model",
                        lambda workdir, log, progress, **k: said.append(progress) or log("trained") or tiny_model_dir)
    monkeypatch.setattr(pipeline, "ensure_demo_artifact",
                        lambda workdir, model, log: log("exported") or tiny_artifact_dir)
    monkeypatch.setattr(pipeline, "demo_data", lambda workdir, log=print: ([], [("one", "un"), ("two", "deux")]))
    r = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path), "--quiet"])
    assert r.exit_code == 0 and r.stdout == "" and r.stderr == "" and said == [False], r.output
    r = CliRunner().invoke(main, ["demo", "--workdir", str(tmp_path)])
    assert "trained" in r.stdout and "exported" in r.stdout and said[-1] is True
