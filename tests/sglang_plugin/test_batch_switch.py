"""--speculative-tree-auto's per-batch-size switch: measured seconds per token decide, per bucket."""

from sglang_spec.sglang_plugin.batch_switch import BatchSwitches


def run(switches, batch_size, steps, tree_seconds, tokens, plain_seconds):
    """Feeds ``steps`` steps to the bucket; returns how many were plain."""
    plain_steps = 0
    for _ in range(steps):
        plain = switches.plain(batch_size)
        plain_steps += plain
        if plain:
            switches.observe(batch_size, True, plain_seconds, batch_size)
        else:
            switches.observe(batch_size, False, tree_seconds, tokens)
    return plain_steps


def test_trees_that_lose_to_plain_decoding_turn_off_and_winning_trees_stay_on():
    switches = BatchSwitches()
    # batch 16: a tree step takes 3x a plain step and emits 1.5x its tokens -> mostly plain
    assert run(switches, 16, 200, tree_seconds=0.3, tokens=24, plain_seconds=0.1) > 150
    # batch 1 (its own bucket): a tree step takes 1.2x a plain step and emits 2.5 tokens -> trees, after the
    # first verdict's measurement of plain steps
    plain_at_one = run(switches, 1, 200, tree_seconds=0.06, tokens=2.5, plain_seconds=0.05)
    assert 0 < plain_at_one <= 4
    assert sorted(switches.switches) == [1, 16]
    assert switches.switch(9) is switches.switch(16) and switches.switch(3) is switches.switch(4)


def test_a_bucket_turning_off_says_so_in_one_line():
    switches = BatchSwitches()
    lines = [switches.observe(4, False, 1.0, 4) for _ in range(4)]
    assert lines[:3] == [None] * 3 and lines[3].startswith("tree auto, batches up to 4: plain for 2 steps")
    assert "\n" not in lines[3]
