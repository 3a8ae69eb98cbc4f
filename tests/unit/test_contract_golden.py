"""The names users and peers depend on stay what they are: every subcommand of `cleave` with its options,
every NATS subject, stream, bucket and key, and every exit code, compared with `golden/contract.json`.
To record them after an intended change: `.venv/bin/python tests/unit/test_contract_golden.py`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cleave import schemas
from cleave.errors import EXIT_FENCED, EXIT_GROUP_LOST, EXIT_JOB_FAILED
from cleave_cli.main import build_parser

GOLDEN = Path(__file__).parent / "golden" / "contract.json"
EXIT_CODES = {"EXIT_FENCED": EXIT_FENCED, "EXIT_JOB_FAILED": EXIT_JOB_FAILED, "EXIT_GROUP_LOST": EXIT_GROUP_LOST}


def _commands(parser: argparse.ArgumentParser, prefix: str = "cleave") -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(_commands(sub, f"{prefix} {name}"))
    out[prefix] = sorted(
        "/".join(a.option_strings) + f"={a.dest}" if a.option_strings else a.dest
        for a in parser._actions if not isinstance(a, (argparse._SubParsersAction, argparse._HelpAction))
    )
    return out


def _names() -> dict[str, str]:
    keep = ("SUBJECT_", "PREFIX", "_STREAM", "_BUCKET", "_KEY", "STATE_OBJECTS")
    return {k: v for k, v in sorted(vars(schemas).items())
            if isinstance(v, str) and k.isupper() and any(p in k for p in keep)}


def _contract() -> dict:
    return {"commands": _commands(build_parser()), "names": _names(), "exit_codes": EXIT_CODES}


def test_the_command_line_names_and_exit_codes_are_the_recorded_ones() -> None:
    golden, now = json.loads(GOLDEN.read_text()), _contract()
    for part in golden:
        assert now[part] == golden[part], f"the {part} changed"


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps(_contract(), indent=1) + "\n")
