"""Every step dataclass survives a round trip through its protobuf message and the wire bytes."""

from __future__ import annotations

import dataclasses

import pytest

from loom_proto.codec import from_pb, pb, to_pb
from loom_proto.step import (
    Fork,
    ModelInfo,
    NewRequest,
    RunningRequest,
    SamplingParams,
    SeqOutput,
    StepPlan,
    StepResult,
    TokenLogprob,
    TokenSample,
    WarmupResult,
)


def full_sampling(seed: int = 2**63 + 5) -> SamplingParams:
    """Every field away from its default, so a dropped field shows."""
    return SamplingParams(
        seed=seed,
        do_sample=True,
        temperature=0.7,
        top_k=40,
        top_p=0.9,
        typical_p=0.95,
        min_p=0.05,
        repetition_penalty=1.1,
        frequency_penalty=0.5,
        presence_penalty=-0.25,
        logit_bias={7: -100.0, 49151: 2.5},
        top_n_tokens=3,
        min_new_tokens=4,
        eos_token_ids=(2, 0),
    )


def sample_plan() -> StepPlan:
    fork = Fork(request_id=11, sampling=full_sampling(seed=9), block_table=[0, 5])
    new = NewRequest(
        request_id=10,
        token_ids=[1, 2, 3, 4, 5, 6],
        num_prompt_tokens=5,
        num_cached=4,
        num_compute=2,
        block_table=[0, 1],
        sampling=full_sampling(),
        prompt_logprobs=True,
        forks=[fork],
    )
    plain = NewRequest(
        request_id=12, token_ids=[9], num_prompt_tokens=1, num_cached=0, num_compute=1,
        block_table=[3], sampling=SamplingParams(seed=0),
    )
    return StepPlan(
        new_requests=[new, plain],
        running_requests=[
            RunningRequest(request_id=3, num_compute=1, new_block_ids=[7]),
            RunningRequest(4, 16, forks=[Fork(13, SamplingParams(seed=5, top_p=0.5), block_table=[2])]),
        ],
        released_ids=[1, 2],
        swap_out=[(6, 0)],
        swap_in=[(1, 8), (2, 9)],
        allowed_token_masks={3: b"\x01\x00\x00\x80", 13: b"\xff" * 8},
    )


def round_trip(obj):
    msg = to_pb(obj)
    wire = type(msg).FromString(msg.SerializeToString())
    return from_pb(wire)


@pytest.mark.parametrize(
    "obj",
    [
        full_sampling(),
        SamplingParams(seed=1),  # every optional filter None, defaults elsewhere
        Fork(request_id=1, sampling=SamplingParams(seed=3), block_table=[4, 2]),
        RunningRequest(request_id=5, num_compute=3, new_block_ids=[1, 2]),
        RunningRequest(request_id=6, num_compute=4, new_block_ids=[3], draft_token_ids=[0, 9, 9]),
        SeqOutput(request_id=6, token_id=4, logprob=-0.5, draft_samples=[
            TokenSample(0, -0.25, [TokenLogprob(0, -0.25), TokenLogprob(8, -2.0)]), TokenSample(7, 0.0)]),
        TokenLogprob(token_id=17, logprob=-0.125),
        SeqOutput(request_id=1, token_id=None, logprob=None),
        SeqOutput(
            request_id=2, token_id=0, logprob=0.0,
            top_tokens=[TokenLogprob(0, 0.0), TokenLogprob(5, -3.75)], prompt_logprobs=[-1.5, -0.3],
            prompt_top_tokens=[[TokenLogprob(3, -0.5), TokenLogprob(9, -1.5)], [TokenLogprob(1, -0.25)]],
        ),
        StepResult(outputs=[SeqOutput(1, 4, -0.5)], forward_ms=12.25, total_ms=13.5, idle_ms=0.75),
        StepResult(outputs=[], forward_ms=0.0, total_ms=0.0),
        ModelInfo(
            architecture="LlamaForCausalLM", num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
            hidden_size=576, vocab_size=49152, max_position_embeddings=8192, dtype="bfloat16",
            weights_hash="ab12", device="cuda:1", block_size=16, rank=1, world_size=2,
            quantization="Q4_1 x120, Q8_0 x1 (loom kernels)",
        ),
        ModelInfo(
            architecture="Gemma3ForCausalLM", num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256,
            hidden_size=1152, vocab_size=262144, max_position_embeddings=32768, dtype="bfloat16",
            weights_hash="cd34", device="cpu", block_size=16, rank=0, world_size=1,
            kv_group_windows=(None, 512, 512, 512, 512, 512, 512),
        ),
        WarmupResult(num_blocks=1024, num_host_blocks=64, block_size=16),
        sample_plan(),
        StepPlan(),
    ],
    ids=lambda obj: type(obj).__name__,
)
def test_round_trip_is_identity(obj):
    assert round_trip(obj) == obj


def test_round_trip_keeps_types_the_dataclasses_declare():
    plan = round_trip(sample_plan())
    sampling = plan.new_requests[0].sampling
    assert isinstance(sampling.eos_token_ids, tuple)
    assert isinstance(sampling.logit_bias, dict)
    assert all(isinstance(pair, tuple) for pair in plan.swap_in)
    assert isinstance(plan.new_requests[0].token_ids, list)


def test_zero_valued_optionals_are_not_none():
    # proto3 would drop a plain 0; the `optional` keyword keeps "set to 0" apart from "unset".
    params = round_trip(SamplingParams(seed=0, top_k=0, top_p=0.0, min_p=0.0))
    assert (params.top_k, params.top_p, params.min_p, params.typical_p) == (0, 0.0, 0.0, None)


def test_new_request_keeps_fork_sampling_apart_from_parent():
    new = round_trip(sample_plan()).new_requests[0]
    assert new.forks[0].sampling.seed == 9
    assert new.sampling.seed == 2**63 + 5


def test_negative_token_id_is_rejected():
    with pytest.raises(ValueError):
        to_pb(TokenLogprob(token_id=-1, logprob=0.0))


def test_unknown_types_are_rejected_both_ways():
    with pytest.raises(TypeError):
        to_pb(object())
    with pytest.raises(TypeError):
        from_pb(pb.HealthRequest())


def test_every_step_dataclass_has_a_message_with_the_same_fields():
    # A field added to loom/common/step.py without the proto and codec fails here. The columns of
    # plain decodes are wire only: the dataclasses hold every output and running request in one list.
    from loom_proto import step

    wire_only = {"StepResult": {"sampled_request_ids", "sampled_token_ids", "sampled_logprobs"},
                 "StepPlan": {"decode_ids"}}
    classes = [c for c in vars(step).values() if dataclasses.is_dataclass(c) and c.__module__ == step.__name__]
    assert len(classes) == 11
    for cls in classes:
        fields = set(getattr(pb, cls.__name__).DESCRIPTOR.fields_by_name) - wire_only.get(cls.__name__, set())
        assert {f.name for f in dataclasses.fields(cls)} == fields, cls.__name__


def mixed_result() -> StepResult:
    return StepResult(outputs=[
        SeqOutput(3, 7, -0.25),
        SeqOutput(1, None, None),  # a prefill chunk
        SeqOutput(2**40, 0, 0.0),
        SeqOutput(4, 5, -1.0, top_tokens=[TokenLogprob(5, -1.0)]),
        SeqOutput(5, 2, -0.5, prompt_logprobs=[-2.0]),
        SeqOutput(6, 9, -0.125, draft_samples=[TokenSample(9, -0.5)]),
        SeqOutput(8, None, None, embedding=[0.5, -0.25]),
        SeqOutput(9, 49151, -3.5),
    ], forward_ms=1.0, total_ms=2.0)


def test_plain_decodes_travel_in_the_sampled_columns():
    message = to_pb(mixed_result())
    assert list(message.sampled_request_ids) == [3, 2**40, 9]
    assert list(message.sampled_token_ids) == [7, 0, 49151]
    assert list(message.sampled_logprobs) == [-0.25, 0.0, -3.5]
    assert [o.request_id for o in message.outputs] == [1, 4, 5, 6, 8]


def test_a_mixed_result_keeps_every_output():
    result = mixed_result()
    back = round_trip(result)
    assert (back.forward_ms, back.total_ms) == (1.0, 2.0)
    by_id = {o.request_id: o for o in back.outputs}
    assert len(by_id) == len(back.outputs) == len(result.outputs)
    assert [by_id[o.request_id] for o in result.outputs] == result.outputs


def test_missing_stubs_say_how_to_generate_them():
    import subprocess
    import sys
    from pathlib import Path

    # A None entry in sys.modules makes `from loom_proto import shard_pb2` fail as if never generated.
    code = "import sys; sys.modules['loom_proto.shard_pb2'] = None; import loom_proto.codec"
    repo_root = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=repo_root, timeout=60)
    assert done.returncode != 0
    assert "run `python proto/generate.py` (make does it)" in done.stderr


@pytest.mark.parametrize("plan", [
    sample_plan(),
    StepPlan(),
    StepPlan(running_requests=[RunningRequest(2**40, 1), RunningRequest(0, 0), RunningRequest(300, 1, [0, 70000])],
             released_ids=[0, 2**63], swap_out=[(0, 0), (128, 1)], allowed_token_masks={0: b"", 5: b"\x00"}),
    StepPlan(running_requests=[RunningRequest(6, 4, [3], draft_token_ids=[0, 9, 300])]),
], ids=["sample", "empty", "edges", "drafts"])
def test_the_plan_written_by_hand_is_the_protobuf_message(plan: StepPlan) -> None:
    """encode_plan (the router's hot path) writes what to_pb's message would serialize."""
    from loom_proto.wire import encode_plan

    wire = encode_plan(plan)
    assert pb.StepPlan.FromString(wire) == to_pb(plan)
    assert from_pb(pb.StepPlan.FromString(wire)) == as_the_shard_sees_it(plan)


def as_the_shard_sees_it(plan: StepPlan) -> StepPlan:
    """The plain decodes (StepPlan.decode_ids) come after the other running requests."""
    running = sorted(plan.running_requests, key=lambda r: r.plain_decode)
    return dataclasses.replace(plan, running_requests=running)


def test_plain_decodes_travel_in_the_decode_ids_column() -> None:
    from loom_proto.wire import encode_plan

    plan = StepPlan(running_requests=[RunningRequest(7, 1), RunningRequest(2**40, 1, [3]), RunningRequest(0, 1),
                                      RunningRequest(9, 2), RunningRequest(300, 1)])
    message = pb.StepPlan.FromString(encode_plan(plan))
    assert list(message.decode_ids) == [7, 0, 300]
    assert [r.request_id for r in message.running_requests] == [2**40, 9]
    assert [r.request_id for r in from_pb(message).running_requests] == [2**40, 9, 7, 0, 300]


def test_the_hand_written_plan_refuses_a_negative_id() -> None:
    from loom_proto.wire import encode_plan

    with pytest.raises(ValueError):
        encode_plan(StepPlan(running_requests=[RunningRequest(-1, 1)]))
