"""Regression: the main commands give the numbers recorded before the refactor (issue 11).

Each case of tests/regression_cases.py runs as a subprocess from the repository root (fresh
cache, one thread), its outputs are extracted and compared with tests/data/regression/<case>.json:
ids, counts, flags and strings exactly, floats within the tolerances of regression_cases
(FLOAT_TOL / FIELD_TOL). The CI suite runs the cases marked ``ci`` (~1 min, one smollm2 case);
``SIPIT_REGRESSION_ALL=1`` runs every recorded case (smollm2 at the last layer, the learned
policy's one-time build: a few minutes). A failure lists each field that differs and by how much.
To re-record after an INTENDED change of numbers: ``python tests/regression_cases.py --record
--check-determinism [--only NAME]``, and say why in the commit.
"""

from __future__ import annotations

import math
import os
import shlex

import pytest

import regression_cases as rc

ALL = os.environ.get("SIPIT_REGRESSION_ALL") == "1"
SELECTED = [c for c in rc.CASES if c.ci or ALL]
MAX_LINES = 30


def _param(case: rc.Case):
    return pytest.param(case, id=case.name, marks=[pytest.mark.smollm] if case.smollm else [])


@pytest.mark.parametrize("case", [_param(c) for c in SELECTED])
def test_case_matches_recording(case, tmp_path):
    recording = rc.load_recording(case.name)
    ran = rc.run_case(case, tmp_path)
    command = shlex.join(case.argv(ran.out, tmp_path))
    if ran.returncode not in (0, 1) or (ran.returncode == 1 and case.command != "invert"):
        pytest.fail(f"{case.name}: `{command}` exited {ran.returncode}\n{ran.stderr[-3000:]}")
    fresh = rc.extract(ran)
    diffs = rc.compare(recording["values"], fresh, field_tol=case.field_tol, filled=case.filled)
    if diffs:
        shown = "\n  ".join(diffs[:MAX_LINES])
        more = f"\n  ... and {len(diffs) - MAX_LINES} more" if len(diffs) > MAX_LINES else ""
        pytest.fail(f"{case.name}: {len(diffs)} field(s) differ from tests/data/regression/{case.name}.json "
                    f"(recorded from commit {recording.get('commit', '?')})\n  command: {command}\n  {shown}{more}",
                    pytrace=False)


def test_every_case_has_a_recording_of_the_same_command():
    """A case edited without re-recording (or a recording without a case) is caught here."""
    names = {c.name for c in rc.CASES}
    assert len(names) == len(rc.CASES), "duplicate case names"
    recorded = {p.stem for p in rc.DATA.glob("*.json")}
    assert recorded == names, f"cases without recording: {sorted(names - recorded)}; " \
                              f"recordings without case: {sorted(recorded - names)}"
    for case in rc.CASES:
        recording = rc.load_recording(case.name)
        assert recording["args"] == list(case.args), f"{case.name}: args changed since it was recorded"
        assert recording["command"] == case.command and case.command in rc.MODULES
    assert sum(c.ci and c.smollm for c in rc.CASES) <= 1, "the CI suite runs at most one smollm2 case"


def test_compare_names_the_field_and_the_difference():
    """The comparison itself: exact for ids and counts, relative tolerance for floats, NaN equals NaN."""
    recorded = {"attacks": {"sipit": {"recovered_ids": [[1, 2, 3]], "token_accuracy": 0.5, "decoder": "SipIt"}},
                "margins": {"median_half_delta": float("nan"), "deltas": [0.25]}, "distances": [1e-8]}
    same = {"attacks": {"sipit": {"recovered_ids": [[1, 2, 3]], "token_accuracy": 0.5 * (1 + 5e-5),
                                  "decoder": "SipIt"}},
            "margins": {"median_half_delta": float("nan"), "deltas": [0.25]}, "distances": [3e-8]}
    assert rc.compare(recorded, same) == []
    changed = {"attacks": {"sipit": {"recovered_ids": [[1, 9, 3]], "token_accuracy": 0.5 * (1 + 2e-4),
                                     "decoder": "SipIt"}},
               "margins": {"median_half_delta": 1.0, "deltas": [0.25, 0.5]}, "distances": [2e-6]}
    diffs = rc.compare(recorded, changed)
    assert len(diffs) == 5, diffs
    text = "\n".join(diffs)
    assert "attacks.sipit.recovered_ids[0][1]: recorded 2, fresh 9 (compared exactly)" in text
    assert "attacks.sipit.token_accuracy: recorded 0.5" in text and "rel diff 0.0002" in text
    assert "margins.median_half_delta: recorded nan, fresh 1.0" in text
    assert "margins.deltas: length 1 recorded, 2 fresh" in text
    assert "distances[0]" in text  # the 1e-6 absolute floor of distances is a floor, not a blank cheque
    assert rc.compare({"n": 3}, {"n": 3.0}) == []  # the same number, whatever JSON made of it
    assert rc.compare({"n": 10000}, {"n": 10000.5}) != []  # a count is never held to a relative tolerance
    assert rc.compare({"ok": True}, {"ok": 1}) != [] and rc.compare({"s": "a"}, {"s": None}) != []
    assert math.isclose(rc.tolerance("attacks.sipit.distances[0][3]")[1], 1e-6)
    assert rc.tolerance("attacks.sipit.token_accuracy") == rc.FLOAT_TOL
    smol = rc.CASE_BY_NAME["run-smollm2-noise-l1"]
    assert rc.tolerance("attacks.sipit.distances[0][3]", smol.field_tol) == (1e-4, 1e-2)
    assert rc.tolerance("margins.deltas[0]", smol.field_tol) == rc.FLOAT_TOL
    # Case.filled lets a field recorded as None be filled in later, nothing else
    filled = (r"^free\.beam\..*\.in_shortlist\[",)
    rec = {"free": {"beam": {"s": {"in_shortlist": [None, True]}}, "map": {"s": {"in_shortlist": [None]}}}}
    now = {"free": {"beam": {"s": {"in_shortlist": [True, True]}}, "map": {"s": {"in_shortlist": [None]}}}}
    assert rc.compare(rec, now, filled=filled) == []
    assert len(rc.compare(rec, {"free": {"beam": {"s": {"in_shortlist": [None, False]}},
                                         "map": {"s": {"in_shortlist": [True]}}}}, filled=filled)) == 2
