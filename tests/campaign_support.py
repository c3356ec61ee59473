"""Running a chaos campaign's command line (``ftengine chaos`` / ``chaos-vllm``) from a test,
as an operator runs it: a child process under a hard timeout, stopped by its pid if it
overruns (SIGTERM: the campaign injects no more faults, reports and stops what it started)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import attrs

STOP_WAIT_S = 120.0  # a campaign stopped mid-fault still stops its deployment


@attrs.frozen
class CampaignRun:
    """The report the campaign printed (empty: none), its exit status, its progress tail."""

    report: dict[str, Any]
    returncode: int | None
    log: str


def network_names() -> set[str]:
    """The links and network namespaces named as ftengine's test bed names them (``ft``
    and a run's tag): what a campaign on hosts must leave as it found."""
    found = set()
    for argv in (["ip", "-br", "link"], ["ip", "netns", "list"]):
        text = subprocess.run(argv, capture_output=True, text=True, check=False).stdout
        found |= {
            line.split()[0].split("@")[0] for line in text.splitlines() if line.startswith("ft")
        }
    return found


def run_campaign(command: list[str], timeout_s: float, progress: Path) -> CampaignRun:
    """Run ``command`` with its progress (stderr) in ``progress``; its JSON report."""
    with progress.open("w") as sink:
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=sink, text=True)
        try:
            out, _ = child.communicate(timeout=timeout_s)
        finally:
            if child.poll() is None:
                child.terminate()
                child.wait(timeout=STOP_WAIT_S)
    log = progress.read_text()[-4000:]
    assert out.strip(), f"the campaign printed no report: {log}"
    return CampaignRun(json.loads(out), child.returncode, log)
