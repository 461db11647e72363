"""`slc bench fuzz`: schemathesis against a real `slc serve`, from the server's own OpenAPI schema
(which carries the loaded model's input shape, the limits and the KServe model names).

Every check of schemathesis runs; the verdict is on the three that matter for a server: no server
error (ST101), every response conforms to its documented schema (ST108), no undocumented status
(ST103). The others are reported with their counts and examples.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tools.report import md_table

EXPLAINED = {
    "ST202": "schemathesis expects every schema-valid request to succeed. Two kinds are refused by design: "
             "finite float32 inputs so large that the network's embedding or logits overflow (422 "
             "`non_finite_output`: there is no JSON number to answer with), and KServe tensors the permissive "
             "infer schema allows but the model cannot take (a wrong datatype, name or shape: 422).",
    "ST201": "a request outside the schema was accepted.",
}
VERDICT_CODES = {"ST101": "server errors", "ST108": "responses violating their schema",
                 "ST103": "undocumented status codes"}


def schemathesis_command(url: str, max_examples: int, seed: int, report: Path) -> list[str]:
    exe = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    return [exe, "run", f"{url}/openapi.json", "--checks", "all", "--max-examples", str(max_examples),
            "--workers", "1", "--seed", str(seed), "--report", "json", "--report-json-path", str(report)]


def run_fuzz(url: str, max_examples: int, seed: int, work: Path) -> dict:
    report = work / "schemathesis.json"
    cmd = schemathesis_command(url, max_examples, seed, report)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=work, timeout=3600)
    if not report.is_file():
        raise RuntimeError(f"schemathesis wrote no report (exit {done.returncode}): {done.stdout[-800:]}{done.stderr[-800:]}")
    r = json.loads(report.read_text())
    failures = {f["code"]: {"title": f["title"], "count": f["count"], "operations": f["operations"]}
                for f in r.get("failures", [])}
    verdict = {name: failures.get(code, {}).get("count", 0) for code, name in VERDICT_CODES.items()}
    return {"schemathesis": r["schemathesis_version"], "seed": r["seed"], "max_examples": max_examples,
            "operations": r["operations"], "test_cases": r["test_cases"], "failures": failures,
            "verdict": verdict, "passed": not any(verdict.values()), "warnings": {k: v for k, v in r["warnings"].items() if v},
            "running_time_s": round(r["running_time"], 1), "output_tail": done.stdout[-4000:]}


def fuzz_markdown(res: dict, command: str) -> str:
    tc, ops = res["test_cases"], res["operations"]
    lines = [f"# Fuzz: schemathesis {res['schemathesis']} against the server's OpenAPI", "",
             f"Command: `{command}` (seed {res['seed']}, {res['running_time_s']} s)", "",
             f"{ops['tested']} operations, {tc['generated']} generated requests, every check of schemathesis.", "",
             md_table(["verdict", "count"], [[name, f"**{n}**"] for name, n in res["verdict"].items()], "lr")]
    lines += ["", f"Verdict: **{'passed' if res['passed'] else 'FAILED'}** (0 of each is the goal).", ""]
    others = {c: f for c, f in res["failures"].items() if c not in VERDICT_CODES}
    if others:
        lines += ["Other findings (not server faults; each explained below the table):", "",
                  md_table(["check", "title", "count", "operations"],
                           [[c, f["title"], f["count"], ", ".join(f["operations"])] for c, f in others.items()], "llrl"), ""]
        lines += [f"- {c}: {EXPLAINED.get(c, 'not explained yet: read the run output in fuzz.json')}" for c in others]
        lines.append("")
    if res["warnings"]:
        lines += ["Warnings of the run: " + "; ".join(f"{k}: {', '.join(map(str, v))}" for k, v in res["warnings"].items()), ""]
    return "\n".join(lines)
