"""`make demo`'s attention part, small: four spawned gloo ranks against the dense reference."""
from __future__ import annotations

import re

from megatron_sap.demo import attention_demo


def test_attention_demo_agrees_with_the_reference(capsys):
    assert attention_demo(total=1024, num_batches=2, seed=1, corpus="sharegpt")
    out = capsys.readouterr().out
    assert out.count("check: errors within 1e-10 and bytes as planned: passed") == 2
    errors = [float(x) for x in re.findall(r"(?:out|dq|dk|dv) ([0-9.e+-]+)", out)]
    assert len(errors) == 2 * 4 and max(errors) < 1e-12, out
    sent = re.findall(r"SAP (\[[^\]]*\]) \(plan (\[[^\]]*\])\)", out)
    assert len(sent) == 2, out  # one line per batch
    for sap_bytes, plan_bytes in sent:
        assert sap_bytes == plan_bytes  # bytes counted at the send sites equal the plan's


def test_demo_rejects_a_row_the_ranks_cannot_share(capsys):
    """A row that 4 ranks cannot split evenly is refused before any worker starts (a worker
    that raised used to leave the demo waiting for its results)."""
    import pytest

    from megatron_sap.demo import main

    for args, pattern in ((["--tokens", "8190"], "--tokens must be a positive multiple of the 4 ranks, got 8190"),
                          (["--batches", "0"], "--batches must be >= 1, got 0")):
        with pytest.raises(SystemExit) as exit_info:
            main([*args, "--skip-training"])
        assert exit_info.value.code == 2 and pattern in capsys.readouterr().err
