"""The root command line (slc/cli.py): every mistake is one line on stderr naming the bad value,
exit 2 for usage and 1 for failures, tracebacks only with --debug; successes end in a summary.
Driven in-process through `slc.cli.main`, the console script's entry point."""
from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from slc.cli import main

ROOT = Path(__file__).resolve().parents[2]


def run(capsys, *args) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of `slc ARGS`."""
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


# (argv, a piece the one line must hold): each a mistake a user makes
MISTAKES = [
    (["trian"], "did you mean train"),
    (["train", "--dataset", "foo", "--out", "{tmp}/r"], "'foo'"),
    (["train", "--dataset", "digits", "--loss", "cee", "--out", "{tmp}/r"], "'cee' is not one of"),
    (["train", "--dataset", "digits", "--backbone", "resnet", "--out", "{tmp}/r"], "unknown backbone 'resnet'"),
    (["train", "--dataset", "digits", "--optimizer", "adamw", "--out", "{tmp}/r"], "'adamw' is not one of 'adam', 'sgd'"),
    (["train", "--dataset", "digits", "--schedule", "step", "--out", "{tmp}/r"], "'step' is not one of"),
    (["train", "--dataset", "digits", "--epochs", "0", "--out", "{tmp}/r"], "--epochs"),
    (["train", "--dataset", "digits", "--lr", "0", "--out", "{tmp}/r"], "--lr"),
    (["train", "--dataset", "synthetic:C=1", "--out", "{tmp}/r"], "C >= 2"),
    (["train", "--dataset", "npz:{tmp}/none.npz", "--out", "{tmp}/r"], "none.npz"),
    (["train", "--dataset", "digits", "--loss-param", "gamma", "--out", "{tmp}/r"], "expected k=v"),
    (["train", "--dataset", "digits", "--loss", "max_margin", "--loss-param", "foo=1", "--out", "{tmp}/r"], "foo"),
    (["train", "--dataset", "digits", "--out", "{tmp}/file/r"], "{tmp}/file"),
    (["train", "--dataset", "digits"], "give --dataset and --out"),
    (["train", "--dataset", "digits", "--device", "tpu", "--out", "{tmp}/r"], "expected auto|cpu|cuda"),
    (["train", "--resume", "{tmp}"], "has no training checkpoint"),
    (["evaluate", "{tmp}/nothing"], "not a run directory"),
    (["export", "{tmp}", "--out", "{tmp}/b"], "not a run directory"),
    (["export", "{tmp}/r", "--out", "{tmp}/b", "--target-precision", "1.5"], "--target-precision"),
    (["serve", "{tmp}/nothing"], "not a bundle directory"),
    (["serve", "--device", "tpu"], "'tpu' is not one of 'auto', 'cpu', 'cuda'"),
    (["serve", "--port", "70000"], "--port"),
    (["verify", "{tmp}/nothing"], "{tmp}/nothing"),
    (["bundle", "synthetic", "--classes", "0", "--out", "{tmp}/b"], "--classes"),
    (["bundle", "synthetic", "--classes", "5", "--rows", "uniform", "--out", "{tmp}/b"], "'uniform' is not one of"),
    (["bundle", "quantize", "{tmp}/nothing"], "not a bundle directory"),
    (["bundle", "synthetic", "--classes", "5", "--head-precision", "fp8", "--out", "{tmp}/b"], "expected a comma list of int8, bf16"),
    (["export", "--head-precision", "int4", "{tmp}/r", "--out", "{tmp}/b"], "unknown head precision 'int4'"),
    (["loadtest", "--url", "127.0.0.1:9", "--endpoint", "detekt", "--out", "{tmp}/lt"], "'detekt' is not an endpoint"),
    (["loadtest", "--url", "127.0.0.1:9", "--rate", "5", "--concurrency", "2", "--out", "{tmp}/lt"], "not both"),
    (["loadtest", "--url", "http://192.0.2.1:80", "--out", "{tmp}/lt"], "--allow-remote"),
    (["bench", "scale", "--classes", "ten", "--out", "{tmp}/s"], "'ten'"),
    (["bench", "nope"], "no command 'nope'"),
    (["experiment", "table1", "--losses", "ce,foo", "--out", "{tmp}/t"], "'foo'"),
]


@pytest.mark.parametrize("argv,needle", MISTAKES, ids=[" ".join(a[:3]) for a, _ in MISTAKES])
def test_a_mistake_is_one_line_and_exit_2(argv, needle, tmp_path, capsys):
    (tmp_path / "file").write_text("a file, not a directory")
    code, out, err = run(capsys, *[a.format(tmp=tmp_path) for a in argv])
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1, err
    assert needle.format(tmp=tmp_path) in lines[0]
    assert "Traceback" not in err and out == ""


def test_no_work_is_done_before_a_mistake_is_reported(tmp_path, capsys):
    """An unwritable --out fails before training starts: no run directory, no progress."""
    (tmp_path / "file").write_text("x")
    code, _, err = run(capsys, "train", "--dataset", "digits", "--out", tmp_path / "file" / "run")
    assert code == 2 and "epoch" not in err and not (tmp_path / "file" / "run").exists()


def test_version_is_the_installed_distribution(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.strip() == f"slc {metadata.version('slc')}"


def test_every_command_is_listed_without_importing_torch():
    code = "import sys; from slc.cli import main\ntry:\n main(['--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip().splitlines()[-1] == "False"
    for name in ("train", "evaluate", "export", "experiment", "verify", "serve", "bundle", "loadtest", "bench"):
        assert f"  {name} " in out.stdout


def _without_the_lab(*args: str) -> subprocess.CompletedProcess:
    """`slc ARGS` in an interpreter where tools/ (slc-lab) cannot be imported, as after `pip install .`."""
    code = f"import sys; sys.modules['tools'] = None\nfrom slc.cli import main\nmain({list(args)!r})"
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("argv", [["loadtest", "--help"], ["loadtest", "--url", "127.0.0.1:9", "--out", "x"],
                                  ["bench", "scale"], ["bench", "scale", "--help"], ["experiment", "table1"]])
def test_a_lab_command_without_the_lab_says_what_to_install_in_one_line(argv):
    """The load tests are one install away from the server-only install: the line names it exactly."""
    out = _without_the_lab(*argv)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0] == (f"error: `slc {' '.join(argv[:2 if argv[0] == 'bench' else 1])}` is part of slc-lab (the load "
                        "tester, benchmarks and experiments), which this install lacks: pip install ./tools "
                        "(from the slc checkout)")


def test_help_without_the_lab_lists_the_product_and_the_lab_apart():
    """`slc --help` without the lab: the product's commands first, the lab's under a heading that says
    how to install them; `slc bench --help` still lists every bench (nothing is imported to list them)."""
    out = _without_the_lab("--help")
    text = out.stdout
    assert out.returncode == 0, out.stderr
    product = text[text.index("Commands:"):text.index("Load tests and benchmarks (slc-lab: pip install ./tools):")]
    for name in ("train", "export", "calibrate", "verify", "serve", "bundle"):
        assert f"  {name} " in product
    assert not [n for n in ("loadtest", "bench", "experiment") if f"  {n} " in product]
    assert "Experiments (slc-lab and torch: pip install '.[train]' ./tools):\n  experiment" in text
    bench = _without_the_lab("bench", "--help")
    assert bench.returncode == 0 and "Single logit against full softmax (slc-lab: pip install ./tools):\n  scale" in bench.stdout


def test_the_help_sections_name_every_command_once():
    from slc.cli import BENCH, BENCH_SECTIONS, COMMANDS, SECTIONS

    for table, sections in ((COMMANDS, SECTIONS), (BENCH, BENCH_SECTIONS)):
        listed = [n for _, names in sections for n in names]
        assert sorted(listed) == sorted(table) and len(set(listed)) == len(listed)


def test_debug_shows_the_traceback_otherwise_one_line(tmp_path, capsys, monkeypatch):
    """An unexplained failure (here: a verify problem turned into a crash) is one line; --debug re-raises."""
    import serving.bundle

    def boom(path):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(serving.bundle, "verify_bundle", boom)
    monkeypatch.setenv("SLC_DEBUG", "0")  # restored after the test (--debug sets it for subprocesses)
    code, _, err = run(capsys, "verify", tmp_path)
    assert code == 1 and err.strip() == "error: RuntimeError: disk on fire (run again with --debug for the traceback)"
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["verify", str(tmp_path), "--debug"])
    monkeypatch.setenv("SLC_DEBUG", "1")
    with pytest.raises(RuntimeError, match="disk on fire"):
        main(["verify", str(tmp_path)])


def test_bundle_and_verify_end_with_a_summary(tmp_path, capsys):
    code, out, err = run(capsys, "bundle", "synthetic", "--classes", 12, "--dim", 4, "--input-dim", 3,
                         "--out", tmp_path / "b")
    assert code == 0, err
    assert out.strip().splitlines()[-1].startswith(f"bundle {tmp_path / 'b'}: 12 clustered classes, d=4")
    code, out, err = run(capsys, "verify", tmp_path / "b")
    assert code == 0, err
    assert out.strip().startswith(f"OK {tmp_path / 'b'}: 12 classes, d=4, 7 files hashed")


def test_bundle_quantize_adds_verified_heads_and_refuses_a_bundle_that_does_not_verify(tmp_path, capsys):
    assert run(capsys, "bundle", "synthetic", "--classes", 12, "--dim", 4, "--input-dim", 3, "--out", tmp_path / "b")[0] == 0
    code, out, err = run(capsys, "bundle", "quantize", tmp_path / "b", "--precision", "int8,bf16")
    assert code == 0, err
    assert out.strip().splitlines()[-1].startswith(f"{tmp_path / 'b'}: int8 head ")
    code, out, err = run(capsys, "verify", tmp_path / "b")
    assert code == 0 and "10 files hashed" in out, (out, err)
    (tmp_path / "b" / "samples.npz").unlink()
    code, _, err = run(capsys, "bundle", "quantize", tmp_path / "b")
    assert code == 1 and err.strip().splitlines()[-1].startswith("error: ") and "does not verify" in err


def test_verify_failure_lists_each_problem_then_one_summary_line(tmp_path, capsys):
    assert run(capsys, "bundle", "synthetic", "--classes", 6, "--dim", 4, "--input-dim", 3, "--out", tmp_path / "b")[0] == 0
    (tmp_path / "b" / "samples.npz").unlink()
    code, _, err = run(capsys, "verify", tmp_path / "b")
    lines = err.strip().splitlines()
    assert code == 1
    assert lines[0].startswith("FAIL samples.npz: missing")
    assert lines[-1] == f"error: {tmp_path / 'b'}: {len(lines) - 1} problem(s); the bundle must not be served"


def test_cli_reference_matches_the_commands():
    """docs/cli.md is generated from the commands (`make docs`): it must not drift from them."""
    from slc.clidoc import render

    assert (ROOT / "docs" / "cli.md").read_text() == render(), "docs/cli.md is stale: run `make docs`"


@pytest.mark.parametrize("var,value,needle", [("SLC_LOG_LEVEL", "loud", "SLC_LOG_LEVEL:"),
                                              ("SLC_MAX_BATCH", "0", "SLC_MAX_BATCH / --max-batch:")])
def test_a_bad_setting_is_one_line_before_the_server_starts(var, value, needle, tmp_path, capsys, monkeypatch):
    assert run(capsys, "bundle", "synthetic", "--classes", 5, "--dim", 4, "--input-dim", 3, "--out", tmp_path / "b")[0] == 0
    monkeypatch.setenv(var, value)
    code, _, err = run(capsys, "serve", tmp_path / "b", "--port", 1)
    assert code == 2 and len(err.strip().splitlines()) == 1 and needle in err and repr(value) in err


@pytest.mark.parametrize("impl", ["ort_pair", "packed_pair"])
def test_two_settings_that_do_not_go_together_are_one_line_before_the_server_starts(impl, tmp_path, capsys, monkeypatch):
    assert run(capsys, "bundle", "synthetic", "--classes", 5, "--dim", 4, "--input-dim", 3, "--out", tmp_path / "b")[0] == 0
    monkeypatch.setenv("SLC_SOFTMAX_IMPL", impl)
    monkeypatch.setenv("SLC_INTRA_OP_THREADS", "1")
    code, _, err = run(capsys, "serve", tmp_path / "b", "--port", 1)
    assert code == 2 and len(err.strip().splitlines()) == 1 and f"{impl} needs intra_op_threads >= 2" in err


def test_serving_nothing_is_one_line_before_the_server_starts(tmp_path, capsys):
    assert run(capsys, "bundle", "synthetic", "--classes", 5, "--dim", 4, "--input-dim", 3, "--out", tmp_path / "b")[0] == 0
    code, _, err = run(capsys, "serve", tmp_path / "b", "--port", 1, "--no-http")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "nothing would be served" in err and "--grpc-port" in err
    assert "Value error" not in err
