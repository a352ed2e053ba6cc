"""The conformance kits catch each way a plugin passed the 0.1 kits and broke at
run time (the mutants in ``kit_mutants.py``): the named kit tests fail for each."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every kit against every mutant tier

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

#: mutant kit class -> kit tests that must fail (or error) for it
MUST_FAIL = {
    "TestOldWayTier": ["test_each_builtin_eviction_policy_drives_the_tier[lru]",
                       "test_each_builtin_eviction_policy_drives_the_tier[s3fifo]",
                       "test_a_storage_manager_serves_the_tier"],
    "TestParentDroppingTier": ["test_the_tier_hands_its_policy_each_parent"],
    "TestNoParentsParameterTier": ["test_the_class_passes_lmkvs_load_check"],
    "TestAbstractTier": ["test_the_class_passes_lmkvs_load_check",
                         "test_put_then_get_returns_identical_bytes",
                         "test_a_storage_manager_serves_the_tier"],
    "TestHandBuiltPolicy": ["test_the_class_passes_lmkvs_load_check"],
    "TestNoRefCPU": ["test_what_a_get_handed_over_stays_the_callers"],
    "TestMemoryWithoutBuffers": ["test_a_tier_that_holds_memory_hands_out_buffers"],
    "TestNameTaken": ["test_missing_key_is_a_miss", "test_a_storage_manager_serves_the_tier"],
    "TestMisplacedMapFS": ["test_direct_chunks_read_what_was_stored"],
    "TestCanonicalIntoOuter": ["test_chunks_hold_each_tokens_kv_in_the_specs_order"],
    "TestOuterChunksCanonicalName": ["test_an_engine_names_the_connectors_chunks"],
    "TestClaimsOuterOnCanonicalSpec": ["test_an_engine_names_the_connectors_chunks"],
    "TestTrustsEveryChecksum": ["test_checked_loads_copy_what_matched_and_fail_what_did_not"],
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """``Class::test`` -> passed / failed / skipped, from one pytest run of the kits
    against every mutant."""
    report = tmp_path_factory.mktemp("mutants") / "report.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    "-o", "python_files=kit_mutants.py", f"--junitxml={report}",
                    str(HERE / "kit_mutants.py")], cwd=ROOT, capture_output=True, text=True,
                   timeout=900)
    found: dict[str, str] = {}
    for case in ET.parse(report).iter("testcase"):
        cls = case.get("classname", "").rpartition(".")[2]
        state = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                state = "failed"
            elif child.tag == "skipped":
                state = "skipped"
        found[f"{cls}::{case.get('name')}"] = state
    return found


@pytest.mark.parametrize("mutant", sorted(MUST_FAIL))
def test_the_kits_catch_the_mutant(outcomes: dict[str, str], mutant: str) -> None:
    for test in MUST_FAIL[mutant]:
        assert outcomes.get(f"{mutant}::{test}") == "failed", \
            f"{mutant}::{test}: {outcomes.get(f'{mutant}::{test}', 'not run')}"


def test_the_correct_classes_pass_the_same_kits(outcomes: dict[str, str]) -> None:
    """The mutants' base classes pass (in test_legacy_plugin): the failures above
    are the mutations', and the kits ran at all."""
    assert any(k.startswith("TestOldWayTier::") for k in outcomes), "the kits did not run"
    assert outcomes["TestParentDroppingTier::test_put_then_get_returns_identical_bytes"] \
        == "passed"
