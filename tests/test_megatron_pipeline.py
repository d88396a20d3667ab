"""SAP on every pipeline stage: the middle ones, which Megatron-LM's `get_batch` gives nothing.

Six gloo ranks run Megatron-Core's GPTModel as three pipeline stages (one layer each; the
embedding on the first, the output layer on the last) at CP 1 and at CP 2, the activations passed
by hand from stage to stage. The first stage splits the packed row and sends its documents to the
middle stage (`stages.send_documents`); the middle stage's model is called as
`pretrain_gpt.py` calls it there, with no tokens and no packed parameters, and takes them from the
hooked `GPTModel.forward`. Changing one document's tokens must change no other document's
per-token losses (without the hook the middle stage attends across documents, and they change),
and CP 2 must give CP 1's losses.
"""
from __future__ import annotations

import pytest
import torch

from dist_pool import make_pool_fixture

pytest.importorskip("megatron.core")

pool6 = make_pool_fixture(6, timeout=300, destroy_job_groups=True)

DOC_LENGTHS = (301, 17, 64, 95, 1, 34)  # 512 tokens
HIDDEN = 64  # build_tiny_gpt's


def _rows() -> tuple[torch.Tensor, list[int], dict, dict]:
    """Tokens and cu_seqlens of the packed row of real documents, the row, and the row with its
    first document's tokens changed."""
    from megatron_sap.megatron.demo_train import packed_batch, stdlib_documents

    tokens, cu = stdlib_documents(DOC_LENGTHS)
    row = packed_batch(tokens, cu)
    changed = dict(row, tokens=row["tokens"].clone())
    changed["tokens"][0, : cu[1]] = (changed["tokens"][0, : cu[1]] + 7) % 256
    return tokens, cu, row, changed


def _last_stage_losses(model, row: dict, cu: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The last stage's split of `row` (labels and loss mask) through `model`: (global position of
    each local token, its loss)."""
    from megatron_sap.megatron import resolve_groups, sap_split_batch
    from megatron_sap.megatron.plans import plan_for

    local, params = sap_split_batch({"labels": row["labels"], "loss_mask": row["loss_mask"]}, cu)
    per_token = model(None, None, None, labels=local["labels"], packed_seq_params=params)
    groups = resolve_groups(None)
    indices = plan_for(torch.tensor(cu, dtype=torch.int32), groups).local_indices(0 if groups is None else groups.cp_rank)
    return indices, per_token.detach()[0]


def _run_stages(model, row: dict, cu: list[int], hooked_middle: bool):
    """This rank's stage of one forward pass of `row`; on the last stage (global position of each
    local token, its loss), elsewhere None."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_sap.megatron import sap_split_batch
    from megatron_sap.megatron.stages import send_documents

    first = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    if first:
        local, params = sap_split_batch(row, cu)
        send_documents(cu, None)  # as the hooked get_batch_on_this_tp_rank does
        hidden = model(local["tokens"], local["position_ids"], None, packed_seq_params=params)
        dist.send(hidden.detach().contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    cp = parallel_state.get_context_parallel_world_size()
    received = torch.empty(cu[-1] // cp, 1, HIDDEN)
    dist.recv(received, parallel_state.get_pipeline_model_parallel_prev_rank())
    model.set_input_tensor(received)
    if not last:
        forward = type(model).forward if hooked_middle else type(model).forward.__wrapped__
        hidden = forward(model, None, None, None)  # pretrain_gpt.py's call on a middle stage
        dist.send(hidden.detach().contiguous(), parallel_state.get_pipeline_model_parallel_next_rank())
        return None
    return _last_stage_losses(model, row, cu)


def run_pipeline_rank(rank: int, world_size: int) -> dict:
    """Per CP size (and at CP 1 without the hook on the middle stage): the last stage's per-token
    losses of the row and of the row with its first document's tokens changed."""
    from types import SimpleNamespace

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_sap.megatron import initialize_sap_parallel
    from megatron_sap.megatron.demo_train import build_tiny_gpt
    from megatron_sap.megatron.hooks import wrap_gpt_forward

    torch.set_num_threads(1)
    tokens, cu, row, changed = _rows()
    args = SimpleNamespace(cp_comm_type="sap")
    original = GPTModel.forward
    GPTModel.forward = wrap_gpt_forward(original, get_args=lambda: args)
    results = {}
    try:
        for name, cp, hooked in (("cp1", 1, True), ("cp2", 2, True), ("cp1 unhooked", 1, False)):
            initialize_sap_parallel(inner_size=1, outer_size=cp, pipeline_model_parallel_size=3)
            try:
                model = build_tiny_gpt(num_layers=3)
                with torch.no_grad():
                    results[name] = [_run_stages(model, r, cu, hooked) for r in (row, changed)]
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        GPTModel.forward = original
    return {"results": results, "cu": cu}


def _global_losses(results: list[dict], name: str, which: int) -> torch.Tensor:
    """The row's per-token losses in packed order, gathered from the last stage's ranks."""
    total = results[0]["cu"][-1]
    losses = torch.full((total,), float("nan"))
    for r in results:
        found = r["results"][name][which]
        if found is not None:
            indices, per_token = found
            losses[indices] = per_token
    return losses


def test_middle_pipeline_stages_keep_documents_apart(pool6) -> None:
    results = pool6.run(run_pipeline_rank)
    first_document = results[0]["cu"][1]
    for name in ("cp1", "cp2", "cp1 unhooked"):
        row, changed = _global_losses(results, name, 0), _global_losses(results, name, 1)
        assert not row.isnan().any() and not changed.isnan().any()
        assert not torch.equal(row[:first_document], changed[:first_document])
        others_equal = torch.equal(row[first_document:], changed[first_document:])
        assert others_equal is (name != "cp1 unhooked"), name  # unhooked, the middle stage attends across documents
    torch.testing.assert_close(_global_losses(results, "cp2", 0), _global_losses(results, "cp1", 0), rtol=1e-5, atol=1e-5)


def run_host_group_rank(rank: int, world_size: int) -> dict:
    """The documents go over a gloo group of the first and middle stages made after the groups
    (not the pipeline group, whose activations would meet them); asked for when it was not
    made, it raises."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_sap.megatron import groups, initialize_sap_parallel
    from megatron_sap.megatron.stages import documents_for, rank_reads_no_data, send_documents

    rows = [[0, 5, 8], [0, 8], [0, 1, 2, 8]]
    found: dict = {}
    try:
        initialize_sap_parallel(inner_size=1, outer_size=2, pipeline_model_parallel_size=3)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        found["reads no data"] = rank_reads_no_data()
        if stage < 2:  # the last stage reads its own data and never joins
            host = groups.pipeline_host_group()[0]
            found["members"] = dist.get_process_group_ranks(host)
            found["own group"] = host is not parallel_state.get_pipeline_model_parallel_group()
        made, real = [], dist.new_group
        dist.new_group = lambda *args, **kwargs: made.append(args) or real(*args, **kwargs)
        try:  # a second call (a patched script through the launcher) makes nothing more
            groups.prepare_pipeline_host_group()
        finally:
            dist.new_group = real
        found["made again"] = len(made)
        if stage < 2:
            found["same host"] = groups.pipeline_host_group()[0] is host
        for cu in rows:
            if stage == 0:
                send_documents(cu, b"plan")
            elif stage == 1:
                found.setdefault("received", []).append(documents_for(None))
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(1, 3, context_parallel_size=2)  # nothing made after it
        if stage < 2:
            with pytest.raises(RuntimeError, match="prepare_pipeline_host_group") as error:
                groups.pipeline_host_group()
            found["unprepared"] = str(error.value)
    finally:
        parallel_state.destroy_model_parallel()
    return {"stage": stage, **found}


def test_documents_go_over_a_host_group_of_the_first_and_middle_stages(pool6) -> None:
    results = pool6.run(run_host_group_rank)
    for rank, r in enumerate(results):
        pipeline = [rank % 2, rank % 2 + 2, rank % 2 + 4]  # PP outermost: stage s of column c is rank c + 2s
        assert r["stage"] == pipeline.index(rank)
        if r["stage"] < 2:
            assert r["members"] == pipeline[:2] and r["own group"] and "prepare_pipeline_host_group" in r["unprepared"]
            assert r["same host"]
        assert r["made again"] == 0
        assert r["reads no data"] is (r["stage"] == 1)  # its data loader plans nothing
        if r["stage"] == 1:
            assert r["received"] == [(cu, b"plan") for cu in ([0, 5, 8], [0, 8], [0, 1, 2, 8])]


def run_silent_first_stage_rank(rank: int, world_size: int) -> dict:
    """A first stage that sends nothing: the middle stage's receive fails within its group's
    timeout (here 3 s) instead of waiting for ever."""
    import datetime
    import time

    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_sap.megatron import groups, initialize_sap_parallel
    from megatron_sap.megatron.stages import documents_for

    found: dict = {}
    try:
        initialize_sap_parallel(inner_size=1, outer_size=2, pipeline_model_parallel_size=3)
        stage = parallel_state.get_pipeline_model_parallel_rank()
        pipeline = parallel_state.get_pipeline_model_parallel_group()
        for column in (0, 1):  # the host groups again, with a short timeout (made by every rank, in one order)
            short = dist.new_group([column, column + 2], backend="gloo", timeout=datetime.timedelta(seconds=3))
            if rank % 2 == column:
                groups._PIPELINE_TWINS[pipeline] = short
        if stage == 1:
            start = time.monotonic()
            with pytest.raises(RuntimeError):
                documents_for(None)
            found["waited_s"] = time.monotonic() - start
    finally:
        parallel_state.destroy_model_parallel()
    return found


def test_a_first_stage_that_sends_nothing_fails_the_middle_one(pool6) -> None:
    results = pool6.run(run_silent_first_stage_rank)
    waits = [r["waited_s"] for r in results if "waited_s" in r]
    assert len(waits) == 2 and all(2.5 <= w <= 60 for w in waits)


def _run_interleaved(models: list, rows: list[tuple[dict, list[int]]]) -> list:
    """The micro-batches `rows` (row, cu_seqlens) through a virtual pipeline of this rank's model
    chunks, in the order Megatron's interleaved schedule runs forward passes with as many
    micro-batches as stages: all of them through chunk 0, then chunk 1 (each chunk takes its
    micro-batches in order; a chunk of a later stage takes a micro-batch after an earlier chunk
    of its stage took the next ones). On the last stage, for each row, (global position of each
    local token, its loss)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_sap.megatron import sap_split_batch
    from megatron_sap.megatron.stages import send_documents

    stage, stages = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_world_size()
    cp = parallel_state.get_context_parallel_world_size()
    losses, sends = [], []
    for chunk, model in enumerate(models):
        for row, cu in rows:
            if stage == 0 and chunk == 0:  # what the hooked get_batch does there: split, documents to the others
                local, params = sap_split_batch(row, cu)
                send_documents(cu, None)
                output = model(local["tokens"], local["position_ids"], None, packed_seq_params=params)
            else:
                received = torch.empty(cu[-1] // cp, 1, HIDDEN)
                dist.recv(received, parallel_state.get_pipeline_model_parallel_prev_rank())
                model.set_input_tensor(received)
                if stage == stages - 1 and chunk == len(models) - 1:
                    losses.append(_last_stage_losses(model, row, cu))
                    continue
                output = model(None, None, None)  # a chunk get_batch gives nothing
            output = output.detach().contiguous()
            sends.append((dist.isend(output, parallel_state.get_pipeline_model_parallel_next_rank()), output))
    for work, _ in sends:
        work.wait()
    return losses


def run_interleaved_rank(rank: int, world_size: int) -> dict:
    """Three stages of two model chunks each (a virtual pipeline), at CP 1 and CP 2: the last
    stage's per-token losses of the row, of the row with its first document changed, and of a
    row of other documents, after them and alone."""
    from types import SimpleNamespace

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from megatron_sap.megatron import initialize_sap_parallel
    from megatron_sap.megatron.demo_train import build_tiny_gpt, packed_batch
    from megatron_sap.megatron.hooks import wrap_gpt_forward

    torch.set_num_threads(1)
    tokens, cu, row, changed = _rows()
    other = [0, *cu[2:]]  # a row of other documents after them: each micro-batch must take its own
    args = SimpleNamespace(cp_comm_type="sap")
    original = GPTModel.forward
    GPTModel.forward = wrap_gpt_forward(original, get_args=lambda: args)
    results = {}
    try:
        for cp in (1, 2):
            initialize_sap_parallel(inner_size=1, outer_size=cp, pipeline_model_parallel_size=3,
                                    virtual_pipeline_model_parallel_size=2)
            try:
                models = [build_tiny_gpt(num_layers=6, vp_stage=chunk) for chunk in (0, 1)]
                with torch.no_grad():
                    found = _run_interleaved(models, [(row, cu), (changed, cu), (packed_batch(tokens, other), other)])
                    alone = _run_interleaved(models, [(packed_batch(tokens, other), other)])
                results[f"cp{cp}"] = found + alone if found else [None] * 4
            finally:
                parallel_state.destroy_model_parallel()
    finally:
        GPTModel.forward = original
    return {"results": results, "cu": cu}


def test_virtual_pipeline_chunks_keep_documents_apart(pool6) -> None:
    """Every model chunk but the first stage's first and the last stage's last gets nothing from
    `get_batch`; through the hook they take each micro-batch's documents (the middle stage two
    chunks per message, the first stage its second chunk from its own copy)."""
    from megatron_sap.megatron.compat import chunk_aware_get_batch

    if not chunk_aware_get_batch():
        pytest.skip("virtual pipelines are refused before core_v0.15")
    results = pool6.run(run_interleaved_rank)
    first_document = results[0]["cu"][1]
    for name in ("cp1", "cp2"):
        row, changed = _global_losses(results, name, 0), _global_losses(results, name, 1)
        assert not row.isnan().any() and not changed.isnan().any()
        assert not torch.equal(row[:first_document], changed[:first_document])
        assert torch.equal(row[first_document:], changed[first_document:]), name
        assert torch.equal(_global_losses(results, name, 2), _global_losses(results, name, 3)), name
    torch.testing.assert_close(_global_losses(results, "cp2", 0), _global_losses(results, "cp1", 0), rtol=1e-5, atol=1e-5)
