"""Scheduler against the fake shard: exact admission, chunking, forking, preemption and freeing."""

from __future__ import annotations

import random

from fake_shard import Driver, FakeShard, fake_prompt_logprob, fake_prompt_top, reference_tokens

from loom_proto.step import SamplingParams, StepPlan
from loom_router.core.request import SeqStatus, SequenceGroup
from loom_router.core.scheduler import Scheduler, SchedulerConfig


def setup(num_host_blocks: int = 0, budget: int = 8, max_new_tokens: int = 10, num_blocks: int = 8,
          **kwargs) -> tuple[Scheduler, FakeShard, Driver]:
    config = SchedulerConfig(block_size=4, num_blocks=num_blocks, num_host_blocks=num_host_blocks,
                             max_batch_prefill_tokens=budget, **kwargs)
    scheduler = Scheduler(config)
    shard = FakeShard(4, num_blocks, num_host_blocks)
    return scheduler, shard, Driver(scheduler, shard, max_new_tokens)


def group(group_id: int, prompt: list[int], seeds: list[int] | None = None,
          prompt_logprobs: bool = False, top_n_tokens: int = 0) -> SequenceGroup:
    seeds = seeds if seeds is not None else [group_id]
    return SequenceGroup.create(group_id, prompt, [SamplingParams(seed=s, top_n_tokens=top_n_tokens) for s in seeds],
                                first_seq_id=group_id * 16, prompt_logprobs=prompt_logprobs)


def summary(plan: StepPlan) -> list[tuple]:
    """A plan's requests as compact tuples: ("new", id, cached, compute, table), ("run", id, compute, new blocks)."""
    rows: list[tuple] = [("new", r.request_id, r.num_cached, r.num_compute, r.block_table)
                         for r in plan.new_requests]
    rows += [("run", r.request_id, r.num_compute, r.new_block_ids) for r in plan.running_requests]
    return rows


def assert_reference_outputs(g: SequenceGroup, num_new_tokens: int) -> None:
    for seq in g.seqs:
        assert seq.output_ids == reference_tokens(g.prompt_ids, seq.sampling.seed, num_new_tokens)


def test_chunked_prefill_then_decode_grows_block_by_block():
    scheduler, _, driver = setup(budget=8)
    g = group(0, list(range(10)))
    scheduler.add(g)
    assert summary(driver.step()) == [("new", 0, 0, 8, [0, 1, 2])]
    assert summary(driver.step()) == [("run", 0, 2, [])]  # completes the prompt, samples
    assert g.seqs[0].num_generated == 1
    assert summary(driver.step()) == [("run", 0, 1, [])]  # position 10
    assert summary(driver.step()) == [("run", 0, 1, [])]  # position 11
    assert summary(driver.step()) == [("run", 0, 1, [3])]  # position 12 starts block 3
    driver.run()
    assert_reference_outputs(g, 10)


def test_new_request_joins_while_others_decode():
    scheduler, _, driver = setup(budget=8)
    a, b = group(0, list(range(5))), group(1, list(range(100, 109)))
    scheduler.add(a)
    assert summary(driver.step()) == [("new", 0, 0, 5, [0, 1])]
    assert summary(driver.step()) == [("run", 0, 1, [])]
    scheduler.add(b)
    # The decode takes 1 token of the budget; b's first chunk gets the other 7.
    assert summary(driver.step()) == [("new", 16, 0, 7, [2, 3, 4]), ("run", 0, 1, [])]
    assert summary(driver.step()) == [("run", 0, 1, []), ("run", 16, 2, [])]
    assert summary(driver.step()) == [("run", 0, 1, [5]), ("run", 16, 1, [])]
    driver.run()
    assert_reference_outputs(a, 10)
    assert_reference_outputs(b, 10)


def test_prefix_reuse_computes_only_the_rest():
    scheduler, _, driver = setup(budget=8, max_new_tokens=2)
    a = group(0, list(range(10)))
    scheduler.add(a)
    driver.run()
    # a's full blocks 0 and 1 stay cached after it finished; block 2 was partial.
    b = group(1, list(range(8)) + [50, 51])
    scheduler.add(b)
    assert summary(driver.step()) == [("new", 16, 8, 2, [0, 1, 3])]
    driver.run()
    assert b.num_cached_prompt_tokens == 8
    assert scheduler.stats.prompt_tokens_cached == 8
    assert scheduler.stats.prompt_tokens_computed == 10 + 2
    assert_reference_outputs(b, 2)


def test_prefix_reuse_while_the_owner_still_runs():
    scheduler, _, driver = setup(budget=8)
    a = group(0, list(range(9)))
    scheduler.add(a)
    driver.step()
    driver.step()  # a's prompt is done: blocks 0, 1 hashed
    b = group(1, list(range(8)) + [77])
    scheduler.add(b)
    assert summary(driver.step()) == [("new", 16, 8, 1, [0, 1, 3]), ("run", 0, 1, [])]
    assert [scheduler.block_manager.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    driver.run()
    assert_reference_outputs(a, 10)
    assert_reference_outputs(b, 10)


def test_n_choices_prefill_the_prompt_once():
    scheduler, shard, driver = setup(budget=8, max_new_tokens=3)
    g = group(0, list(range(6)), seeds=[10, 11, 12, 13])
    scheduler.add(g)
    plan = driver.step()
    assert summary(plan) == [("new", 0, 0, 6, [0, 1])]
    assert [(f.request_id, f.block_table) for f in plan.new_requests[0].forks] == [
        (1, [0, 2]), (2, [0, 3]), (3, [0, 4])]
    assert [seq.num_generated for seq in g.seqs] == [1, 1, 1, 1]
    assert scheduler.stats.prompt_tokens_computed == 6
    assert summary(driver.step()) == [("run", 0, 1, []), ("run", 1, 1, []), ("run", 2, 1, []),
                                      ("run", 3, 1, [])]
    driver.run()
    assert scheduler.stats.prompt_tokens_computed == 6
    assert_reference_outputs(g, 3)
    assert len({tuple(seq.output_ids) for seq in g.seqs}) == 4  # the seeds do differ


def test_n_choices_fork_on_the_chunk_that_completes_the_prompt():
    scheduler, _, driver = setup(budget=8, max_new_tokens=4)
    g = group(0, list(range(10)), seeds=[1, 2])
    scheduler.add(g)
    assert summary(driver.step()) == [("new", 0, 0, 8, [0, 1, 2])]
    plan = driver.step()
    assert summary(plan) == [("run", 0, 2, [])]
    assert [(f.request_id, f.block_table) for f in plan.running_requests[0].forks] == [(1, [0, 1, 3])]
    driver.run()
    assert scheduler.stats.prompt_tokens_computed == 10
    assert_reference_outputs(g, 4)


def two_long_decoders(num_host_blocks: int) -> tuple[Scheduler, FakeShard, Driver, SequenceGroup, SequenceGroup]:
    """a and b both prefill 8 tokens, then decode 20 tokens each: 14 blocks wanted, 8 exist."""
    scheduler, shard, driver = setup(num_host_blocks=num_host_blocks, budget=16, max_new_tokens=20)
    a, b = group(0, list(range(8))), group(1, list(range(100, 108)))
    scheduler.add(a)
    scheduler.add(b)
    for _ in range(9):
        driver.step()
    assert [seq.block_table for seq in (a.seqs[0], b.seqs[0])] == [[0, 1, 4, 6], [2, 3, 5, 7]]
    return scheduler, shard, driver, a, b


def test_preemption_by_swap_resumes_with_the_same_tokens():
    scheduler, shard, driver, a, b = two_long_decoders(num_host_blocks=8)
    plan = driver.step()  # a's position 16 needs a block: b (newest) goes to host RAM
    assert plan.swap_out == [(2, 0), (3, 1), (5, 2), (7, 3)]
    assert plan.released_ids == [16]
    assert summary(plan) == [("run", 0, 1, [7])]  # b's blocks stay cached until evicted: LRU 7
    assert b.seqs[0].status is SeqStatus.PREEMPTED and b.swapped
    c = group(2, [1, 2])
    scheduler.add(c)  # c would fit, but b was first
    plans = [driver.step() for _ in range(11)]
    assert all(not p.new_requests for p in plans[:10])
    resume = plans[10]  # a finished: b comes back before c
    assert resume.released_ids == [0]
    assert resume.swap_in == [(0, 3), (1, 2), (2, 5), (3, 7)]
    assert summary(resume)[:2] == [("new", 16, 16, 1, [3, 2, 5, 7, 6]), ("new", 32, 0, 2, [4])]
    driver.run()
    # c is preempted later on too (b and c want 13 blocks): always by swap here.
    assert scheduler.stats.preemptions_swap >= 1 and scheduler.stats.preemptions_recompute == 0
    assert scheduler.stats.swapped_blocks >= 8
    for g in (a, b):
        assert_reference_outputs(g, 20)


def test_preemption_by_recompute_resumes_with_the_same_tokens():
    scheduler, shard, driver, a, b = two_long_decoders(num_host_blocks=0)
    plan = driver.step()
    assert plan.swap_out == [] and plan.released_ids == [16]
    assert summary(plan) == [("run", 0, 1, [7])]
    assert b.seqs[0].block_table == [] and b.seqs[0].num_computed == 0
    plans = [driver.step() for _ in range(11)]
    # b's block 2 (its first 4 tokens) survived in the prefix cache: the rest is recomputed,
    # in a's freed partial block 3 and then the least recently freed cached blocks.
    assert summary(plans[10]) == [("new", 16, 4, 13, [2, 3, 5, 7, 6])]
    driver.run()
    assert scheduler.stats.preemptions_recompute == 1 and scheduler.stats.preemptions_swap == 0
    for g in (a, b):
        assert_reference_outputs(g, 20)


def test_preempted_n_group_mid_prompt_resumes_and_forks_correctly():
    for num_host_blocks in (0, 8):
        scheduler, _, driver = setup(num_host_blocks=num_host_blocks, budget=4, max_new_tokens=8)
        a, b = group(0, list(range(7))), group(1, list(range(50, 57)), seeds=[5, 6])
        scheduler.add(a)
        scheduler.add(b)
        driver.run()
        assert scheduler.stats.preemptions_swap + scheduler.stats.preemptions_recompute > 0
        assert_reference_outputs(a, 8)
        assert_reference_outputs(b, 8)


def test_decodes_count_toward_the_step_budget():
    scheduler, _, driver = setup(budget=4)
    scheduler.add(group(0, [1, 2]))
    scheduler.add(group(1, [3, 4]))
    driver.step()
    scheduler.add(group(2, list(range(10, 20))))
    assert summary(driver.step()) == [("new", 32, 0, 2, [2, 3, 4]), ("run", 0, 1, []), ("run", 16, 1, [])]


def test_max_num_seqs_caps_admission():
    scheduler, _, driver = setup(max_num_seqs=2)
    for i in range(3):
        scheduler.add(group(i, [i, i + 1]))
    assert [r[1] for r in summary(driver.step())] == [0, 16]
    assert scheduler.stats.num_waiting == 1


def test_finish_frees_now_and_releases_next_plan():
    scheduler, shard, driver = setup(max_new_tokens=1)
    scheduler.add(group(0, [1, 2, 3]))
    driver.step()
    assert scheduler.block_manager.num_free_blocks == 8
    assert scheduler.has_work()
    plan = driver.step()
    assert plan.released_ids == [0] and plan.num_requests == 0
    assert shard.states == {} and not scheduler.has_work() and scheduler.schedule() is None


def test_abort_while_the_step_runs_releases_next_plan():
    scheduler, shard, _ = setup()
    scheduler.add(group(0, [1, 2, 3]))
    plan = scheduler.schedule()
    scheduler.abort(0)
    assert scheduler.block_manager.num_free_blocks == 8
    assert scheduler.update(plan, shard.step(plan)) == []
    flush = scheduler.schedule()
    assert flush.released_ids == [0]
    shard.step(flush)
    assert shard.states == {}


def test_abort_waiting_group_releases_nothing():
    scheduler, _, driver = setup(budget=32)
    scheduler.add(group(0, list(range(24))))  # 6 blocks
    scheduler.add(group(1, list(range(8))))  # 2 blocks + 1 for its first decode: 2 are free
    assert [r[1] for r in summary(driver.step())] == [0]
    assert scheduler.block_manager.num_free_blocks == 2
    scheduler.abort(1)
    assert scheduler.stats.num_waiting == 0 and scheduler.schedule().released_ids == []


def test_prompt_logprobs_cover_every_position_once():
    scheduler, _, driver = setup(budget=4, max_new_tokens=2)
    scheduler.add(group(0, list(range(10))))
    driver.run()  # fills the prefix cache, which a prompt-logprobs request must not use
    g = group(1, list(range(10)), prompt_logprobs=True)
    scheduler.add(g)
    received: list[float] = []
    while scheduler.has_work():
        plan = scheduler.schedule()
        for seq, out in scheduler.update(plan, driver.shard.step(plan)):
            received += out.prompt_logprobs
            if seq.num_generated >= 2:
                scheduler.finish(seq)
    assert received == [fake_prompt_logprob(t) for t in range(1, 10)]
    assert g.num_cached_prompt_tokens == 0


def test_can_ever_fit():
    scheduler, _, _ = setup(max_num_seqs=2)
    assert scheduler.can_ever_fit(32, 1) and not scheduler.can_ever_fit(33, 1)
    assert scheduler.can_ever_fit(16, 2) and not scheduler.can_ever_fit(17, 2)
    assert not scheduler.can_ever_fit(4, 3)


def test_random_load_with_aborts_leaks_nothing():
    rng = random.Random(7)
    scheduler, shard, driver = setup(num_host_blocks=4, budget=8, max_new_tokens=6)
    prefixes = [[rng.randrange(1000) for _ in range(8)] for _ in range(3)]
    live: list[SequenceGroup] = []
    done: list[SequenceGroup] = []
    aborted: set[int] = set()
    for group_id in range(60):
        prompt = rng.choice(prefixes)[:rng.randint(0, 8)] + [rng.randrange(1000) for _ in range(rng.randint(1, 6))]
        n = rng.randint(1, 3)
        if scheduler.can_ever_fit(len(prompt) + 6, n):
            g = group(group_id, prompt, seeds=[group_id * 10 + i for i in range(n)])
            scheduler.add(g)
            live.append(g)
        for _ in range(rng.randint(0, 3)):
            plan = scheduler.schedule()
            if plan is None:
                break
            if live and rng.random() < 0.1:  # cancelled while the step runs
                victim = live.pop(rng.randrange(len(live)))
                scheduler.abort(victim.group_id)
                aborted.add(victim.group_id)
            result = shard.step(plan)
            shard.verify()
            for seq, out in scheduler.update(plan, result):
                driver._maybe_finish(seq, out)
            done += [g for g in live if g.is_finished]
            live = [g for g in live if not g.is_finished]
    driver.run()
    done += live
    bm = scheduler.block_manager
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0 and bm.num_free_host_blocks == 4
    assert all(block.ref_count == 0 for block in bm.blocks) and bm.num_pending_hashes == 0
    assert shard.states == {}
    assert scheduler.stats.preemptions_swap + scheduler.stats.preemptions_recompute > 0
    assert scheduler.stats.prompt_tokens_cached > 0
    finished = [g for g in done if g.group_id not in aborted]
    assert len(finished) > 20
    for g in finished:
        assert_reference_outputs(g, 6)


def preempt_n_group_mid_prompt(num_host_blocks: int) -> tuple[Scheduler, Driver, SequenceGroup, SequenceGroup, StepPlan]:
    """a decodes and grows; b (n=2, 13-token prompt, 1 token a step) is preempted mid-prompt."""
    scheduler, _, driver = setup(num_host_blocks=num_host_blocks, budget=2)
    driver.max_new_tokens_of = {0: 14, 1: 3}
    a = group(0, [1, 2])
    b = group(1, list(range(20, 33)), seeds=[5, 6], prompt_logprobs=True, top_n_tokens=2)
    scheduler.add(a)
    driver.step()
    scheduler.add(b)
    plan = driver.step()
    assert summary(plan) == [("new", 16, 0, 1, [1, 2, 3, 4]), ("run", 0, 1, [])]
    assert b.seqs[1].block_table == [1, 2, 3, 5]  # its own copy of the partial last block
    while not plan.released_ids:
        plan = driver.step()
    assert plan.released_ids == [16]  # only the parent was on the shard
    assert b.seqs[0].num_generated == 0  # still mid-prompt
    assert not b.forked and b.seqs[0].status is SeqStatus.PREEMPTED
    return scheduler, driver, a, b, plan


def test_n_group_swapped_mid_prompt_forks_after_resume():
    scheduler, driver, a, b, plan = preempt_n_group_mid_prompt(num_host_blocks=8)
    assert [host for _, host in plan.swap_out] == [0, 1, 2, 3, 4]  # parent's 4 + child's copy
    assert b.seqs[1].host_block_table == [0, 1, 2, 4]
    driver.run()
    assert scheduler.stats.preemptions_swap == 1
    assert scheduler.stats.prompt_tokens_computed == 2 + 13  # swapping kept b's computed prefix
    assert_reference_outputs(a, 14)
    assert_reference_outputs(b, 3)
    assert driver.prompt_logprobs[16] == [fake_prompt_logprob(t) for t in range(21, 33)]


def test_n_group_recomputed_mid_prompt_forks_after_resume():
    scheduler, driver, a, b, plan = preempt_n_group_mid_prompt(num_host_blocks=0)
    assert plan.swap_out == [] and all(not seq.block_table for seq in b.seqs)
    driver.run()
    assert scheduler.stats.preemptions_recompute == 1
    assert scheduler.stats.prompt_tokens_computed > 2 + 13  # part of b's prompt ran twice
    assert_reference_outputs(a, 14)
    assert_reference_outputs(b, 3)
    # Recomputed prompt positions are not reported twice, nor their alternatives.
    assert driver.prompt_logprobs[16] == [fake_prompt_logprob(t) for t in range(21, 33)]
    assert driver.prompt_top_tokens[16] == [fake_prompt_top(t, 2) for t in range(21, 33)]


def test_max_batch_total_tokens_caps_the_pool():
    scheduler, _, _ = setup(max_batch_total_tokens=16)
    assert scheduler.stats.blocks_total == 4 and scheduler.block_manager.num_blocks == 4
    assert scheduler.can_ever_fit(16, 1) and not scheduler.can_ever_fit(17, 1)


def test_identical_prefixes_arriving_together_are_computed_once():
    scheduler, _, driver = setup(budget=64, num_blocks=64, max_new_tokens=3)
    prefix = list(range(500, 512))  # 3 full blocks
    groups = [group(i, prefix + [i, 100 + i]) for i in range(8)]
    for g in groups:
        scheduler.add(g)
    first = driver.step()
    assert summary(first) == [("new", 0, 0, 14, [0, 1, 2, 3])]  # the others wait one step
    second = driver.step()
    assert [(r.request_id, r.num_cached, r.num_compute) for r in second.new_requests] == [
        (16 * i, 12, 2) for i in range(1, 8)]
    driver.run()
    assert scheduler.stats.prompt_tokens_computed == 12 + 8 * 2
    assert scheduler.stats.prompt_tokens_cached == 7 * 12
    assert scheduler.block_manager.num_pending_hashes == 0
    for g in groups:
        assert_reference_outputs(g, 3)


def test_prefix_still_prefilling_in_chunks_holds_back_its_sharers():
    scheduler, _, driver = setup(budget=8, num_blocks=32, max_new_tokens=2)
    prefix = list(range(500, 512))  # 3 full blocks: the first prompt takes two chunks
    a, b, c = group(0, prefix + [1]), group(1, prefix + [2]), group(2, [7, 8, 9])
    for g in (a, b, c):
        scheduler.add(g)
    assert summary(driver.step()) == [("new", 0, 0, 8, [0, 1, 2, 3])]
    # Blocks 0-1 are cached now, block 2 is being computed: b (and c behind it, FIFO) wait
    # although 3 tokens of the budget are left.
    assert summary(driver.step()) == [("run", 0, 5, [])]
    plan = driver.step()
    assert [(r.request_id, r.num_cached, r.num_compute) for r in plan.new_requests] == [(16, 12, 1), (32, 0, 3)]
    driver.run()
    assert scheduler.stats.prompt_tokens_computed == 13 + 1 + 3
    for g in (a, b, c):
        assert_reference_outputs(g, 2)


def test_prompt_logprobs_request_does_not_wait_for_a_pending_prefix():
    scheduler, _, driver = setup(budget=64, num_blocks=32, max_new_tokens=2)
    prefix = list(range(500, 512))
    a, b = group(0, prefix + [1]), group(1, prefix + [2], prompt_logprobs=True)
    scheduler.add(a)
    scheduler.add(b)
    assert [r.request_id for r in driver.step().new_requests] == [0, 16]
    driver.run()
    assert scheduler.stats.prompt_tokens_computed == 2 * 13


def test_preempted_groups_resume_before_a_long_queue_of_new_ones():
    scheduler, shard, driver, a, b = two_long_decoders(num_host_blocks=8)
    driver.step()  # b is swapped out
    assert b.swapped
    newcomers = [group(10 + i, [i + 1, i + 2]) for i in range(20)]
    for g in newcomers:
        scheduler.add(g)  # each would fit on its own right now
    admitted: list[int] = []
    while scheduler.has_work():
        plan = driver.step()
        admitted += [r.request_id // 16 for r in plan.new_requests if r.request_id // 16 not in admitted]
    assert admitted[0] == 1  # b first
    assert admitted[1:] == [g.group_id for g in newcomers]  # then the queue in order
    for g in (a, b, *newcomers):
        assert_reference_outputs(g, 20)
