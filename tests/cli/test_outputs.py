"""Every command that writes a folder, walked through the same hostile folders (serving/bundle/output.py):
each is refused in one line, exit 2, before any work, and every byte of the user's files is unchanged.

The table below must name every command that has an --out option: a new command that writes a folder
fails here until it is guarded (`serving.bundle.cliopts.guarded`) and walked."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest

from tests.serving.bundle.test_output import snapshot

ROOT = Path(__file__).resolve().parents[2]

# command -> the arguments that make it valid but for its --out ({...}: fixtures below)
COMMANDS = {
    "train": ["--dataset", "digits", "--backbone", "mlp", "--loss", "ce", "--epochs", "1"],
    "export": ["{run}"],
    "calibrate": ["{bundle}", "--data", "imagefolder:{images}"],
    "bundle synthetic": ["--classes", "4", "--dim", "8"],
    "bundle triton": ["{bundle}"],
    "bundle fold": ["{bundle}", "--from", "{store}"],
    "experiment adapt-no-forget": ["{bundle}"],
    "experiment calibration": ["{run}"],
    "experiment detect-table": ["{study}"],
    "experiment enroll": ["{run}", "--work", "{work}"],
    "experiment glyphs": ["--dataset", "glyphs-latin"],
    "experiment table1": ["--dataset", "digits"],
    "experiment thresholds": ["{run}"],
    "experiment user-calibration": ["{run}"],
    "loadtest": ["--url", "http://127.0.0.1:9"],
    "bench scale": [], "bench index": [], "bench soak": [], "bench routes": [], "bench mixed": [],
    "bench hostile": [], "bench fuzz": [], "bench device": [], "bench gpu": [], "bench enroll": [],
    "bench many-models": [], "bench neighbours": [], "bench replica": [],
    "bench losses": [], "bench head": [],
    "bench ab": ["--base", "{work}"],
    "bench precision": ["--bundle", "{bundle}"],
    "bench agreement": ["{bundle}", "--inputs", "{inputs}", "--labels", "{labels}"],
    "bench gallery": ["--gallery-url", "postgresql://127.0.0.1:9/none"],
}
WHOLE = {"train", "export", "calibrate", "bundle synthetic", "bundle triton", "bundle fold"}  # the rest: reports
WHOLE_CASES = ["user_folder", "stray_manifest", "holds_the_input", "symlink", "a_file", "racing_writer"]
REPORT_CASES = ["a_file", "is_the_input", "racing_writer"]


def commands_with_out() -> dict[str, click.Command]:
    from slc.cli import root

    found, ctx = {}, click.Context(root)

    def walk(group: click.Group, path: list[str]) -> None:
        for name in group.list_commands(ctx):
            try:
                cmd = group.get_command(ctx, name)
            except click.ClickException:  # a command whose extra is not installed
                continue
            if isinstance(cmd, click.Group):
                walk(cmd, path + [name])
            elif any("--out" in getattr(p, "opts", ()) for p in cmd.params):
                found[" ".join(path + [name])] = cmd

    walk(root, [])
    return found


def test_every_command_with_an_out_folder_is_guarded_and_walked_here():
    found = commands_with_out()
    assert sorted(found) == sorted(COMMANDS), "add the command to COMMANDS (and guard it) / drop a removed one"
    unguarded = [name for name, cmd in found.items() if not getattr(cmd.callback, "slc_output", None)]
    assert not unguarded
    kinds = {name: cmd.callback.slc_output for name, cmd in found.items()}
    assert {name for name, kind in kinds.items() if kind != "report folder"} == WHOLE


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """The inputs every command is given: a bundle, a run folder, images, a store, arrays."""
    from serving.bundle.synthetic import build_synthetic_bundle

    base = tmp_path_factory.mktemp("inputs")
    bundle = build_synthetic_bundle(classes=4, dim=8, input_dim=6, out=base / "bundle")
    run = base / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"loss": "ce", "dataset": "digits", "steps": 1}))
    (run / "data.json").write_text("{}")
    (run / "checkpoint.pt").write_bytes(b"")
    (base / "images" / "0").mkdir(parents=True)
    (base / "store").mkdir()
    (base / "work").mkdir()
    (base / "study.json").write_text("{}")
    np.save(base / "inputs.npy", np.zeros((2, 6), np.float32))
    np.save(base / "labels.npy", np.zeros(2, np.int64))
    return {"bundle": bundle, "run": run, "images": base / "images", "store": base / "store", "work": base / "work",
            "study": base / "study.json", "inputs": base / "inputs.npy", "labels": base / "labels.npy"}


def _args(name: str, inputs: dict[str, Path]) -> list[str]:
    return [a.format(**{k: str(v) for k, v in inputs.items()}) for a in COMMANDS[name]]


def _combinations() -> list[tuple[str, str]]:
    """(command, case) for every case that applies: a command without an input has no "holds the input"."""
    out = []
    for name, args in COMMANDS.items():
        has_input = any("{" in a for a in args)
        for case in (WHOLE_CASES if name in WHOLE else REPORT_CASES):
            if has_input or case not in ("holds_the_input", "is_the_input"):
                out.append((name, case))
    return out


def _out(case: str, name: str, tmp: Path, inputs: dict[str, Path]) -> Path:
    """The hostile --out of a case."""
    user = tmp / "user"
    user.mkdir()
    (user / "notes.txt").write_text("a user's notes\n")
    (user / "sub").mkdir()
    (user / "sub" / "data.bin").write_bytes(os.urandom(64))
    if case == "stray_manifest":
        (user / "manifest.json").write_text('{"name": "a web app", "version": 3}\n')
    if case == "symlink":
        (tmp / "link").symlink_to(user)
        return tmp / "link"
    if case == "a_file":
        return user / "notes.txt"
    if case == "racing_writer":
        return tmp / "fresh"
    if case in ("holds_the_input", "is_the_input"):
        key = next(a for a in COMMANDS[name] if "{" in a).split("{")[1].rstrip("}")
        return inputs[key] if case == "is_the_input" else inputs[key].parent
    return user


def _hold_lock(target: Path) -> subprocess.Popen:
    code = ("import sys; from pathlib import Path; from serving.bundle.output import lock\n"
            "with lock(Path(sys.argv[1])):\n    print('held', flush=True); sys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", code, str(target)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.parametrize("name,case", _combinations())
def test_a_hostile_out_is_one_line_exit_2_and_every_byte_stays(name, case, tmp_path, inputs, monkeypatch, capsys):
    from slc.cli import main

    out = _out(case, name, tmp_path, inputs)
    monkeypatch.chdir(tmp_path)
    watched = [tmp_path, inputs["bundle"].parent]
    before = [snapshot(w) for w in watched]
    holder = _hold_lock(out) if case == "racing_writer" else None
    try:
        with pytest.raises(SystemExit) as exit_:
            main(name.split() + _args(name, inputs) + ["--out", str(out)])
    finally:
        if holder is not None:
            holder.communicate("")
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err and str(out) in err, err
    assert [snapshot(w) for w in watched] == before
    if case == "racing_writer":
        assert "being written by another slc command" in err and not out.exists()
