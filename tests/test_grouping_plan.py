"""The grouping plan's cut rules (tf_mpi/policy/grouping.py, rules a-e of its docstring) on synthetic
layer lists, then on the benchmark models' layer lists (single process; the plan on a real model
and its agreement across ranks are checked in keras_worker.py)."""
import random

import pytest

from tf_mpi.policy.grouping import MIN_GROUP_COST_FACTOR, CostModel, Group, Plan, _cut_when_bandwidth_bound, layer_of

# alpha 50 us, beta 1 ns/B: break-even 50 kB, so with full overlap a group is bandwidth-bound
# from 200 kB (MIN_GROUP_COST_FACTOR x break-even).
MODEL = CostModel(alpha=50e-6, beta=1e-9)
NO_OVERLAP = CostModel(alpha=50e-6, beta=1e-9, overlap=0.0)
BANDWIDTH_BOUND = 200_000
MIB = 1 << 20
K = 1000


def layer_list(*layers):
    """(sizes, layers) of the tensors of `layers` in backprop order; each layer is a list of byte
    counts, named L0, L1, ... (what make_plan reads from variable paths)."""
    sizes = [n for layer in layers for n in layer]
    names = [f"L{k}" for k, layer in enumerate(layers) for _ in layer]
    return sizes, names


def cut(layers, model=MODEL, threshold=4 * MIB):
    sizes, names = layer_list(*layers)
    return _cut_when_bandwidth_bound(range(len(sizes)), sizes, model, threshold, names)


def test_factor_is_what_the_numbers_below_assume():
    assert MIN_GROUP_COST_FACTOR == 4 and MODEL.break_even_bytes * MIN_GROUP_COST_FACTOR == BANDWIDTH_BOUND


# ----------------------------------------------------------------------------- the rules, one by one

def test_rule_a_a_group_closes_once_bandwidth_bound():
    # One-tensor layers of 100 kB: every second one makes the group bandwidth-bound (200 kB).
    assert cut([[100 * K]] * 4) == [[0, 1], [2, 3]]
    # Each 300 kB layer is bandwidth-bound on its own: a message each.
    assert cut([[300 * K]] * 3) == [[0], [1], [2]]
    # Latency-bound layers keep joining until the group is bandwidth-bound.
    assert cut([[40 * K]] * 5 + [[300 * K]]) == [[0, 1, 2, 3, 4], [5]]


def test_rule_b_the_cut_waits_for_the_end_of_the_layer():
    # Bandwidth-bound after two of its three tensors, the first layer still goes out whole.
    assert cut([[150 * K, 150 * K, 150 * K], [300 * K]]) == [[0, 1, 2], [3]]
    # The same sizes without layers (every tensor a layer of its own) are cut inside.
    sizes = [150 * K, 150 * K, 150 * K, 300 * K]
    assert _cut_when_bandwidth_bound(range(4), sizes, MODEL, 4 * MIB) == [[0, 1], [2, 3]]


def test_rule_c_the_byte_bound_cuts_before_the_tensor_that_would_pass_it():
    # Inside one layer too: 3 x 600 kB with a 1 MB bound.
    assert cut([[600 * K] * 3], threshold=1 * MIB) == [[0], [1], [2]]
    # A group may reach the bound exactly.
    assert cut([[MIB // 2], [MIB // 2], [1]], NO_OVERLAP, threshold=MIB) == [[0, 1], [2]]


def test_rule_d_a_tensor_over_the_bound_takes_the_latency_bound_group_before_it():
    # 2 kB + 10 kB latency-bound, then a 10 MB tensor: one message, not a 12 kB one of its own first.
    assert cut([[10 * K, 2 * K], [10 * MIB]]) == [[0, 1, 2]]
    # A bandwidth-bound group before it is not merged: it is worth its own message.
    assert cut([[300 * K], [2 * MIB]], threshold=MIB) == [[0], [1]]
    # Alone, a tensor over the bound is a group of its own.
    assert cut([[5 * MIB], [5 * MIB]]) == [[0], [1]]
    # With no overlap every group is latency-bound: the big tensor takes everything since the last cut.
    assert cut([[3 * MIB], [3 * MIB], [5 * MIB]], NO_OVERLAP) == [[0], [1, 2]]
    assert cut([[5 * MIB], [5 * MIB]], NO_OVERLAP) == [[0, 1]]


def test_rule_e_a_latency_bound_remainder_at_the_end_joins_the_group_before_it():
    # 10 kB after a bandwidth-bound 300 kB group would be a message with nothing left to overlap.
    assert cut([[300 * K], [8 * K, 2 * K]]) == [[0, 1, 2]]
    # ... unless both together would pass the byte bound.
    assert cut([[900 * K], [9 * K]], threshold=900 * K) == [[0], [1]]
    # A bandwidth-bound last group is not a remainder: it stays on its own.
    assert cut([[300 * K], [300 * K]]) == [[0], [1]]
    # With no overlap, after a byte-bound cut.
    assert cut([[3 * MIB], [3 * MIB], [MIB // 2]], NO_OVERLAP) == [[0], [1, 2]]


def test_no_overlap_leaves_only_the_byte_bound():
    # Nothing is worth an early message: layers and sizes do not matter below the bound ...
    assert cut([[300 * K, 300 * K], [1 * MIB], [40 * K]], NO_OVERLAP) == [[0, 1, 2, 3]]
    assert cut([[4 * K]] * 10, NO_OVERLAP) == [list(range(10))]
    # ... and the bound still holds for a model larger than it.
    assert cut([[3 * MIB]] * 4, NO_OVERLAP) == [[0], [1], [2], [3]]


def test_partial_overlap_raises_the_bandwidth_bound_by_its_inverse():
    # At overlap 1 a group is worth sending from 200 kB; at 0.5 only half its transfer hides,
    # so it takes 400 kB (and the 300 kB left at the end joins it by rule e).
    assert cut([[300 * K]] * 3) == [[0], [1], [2]]
    assert cut([[300 * K]] * 3, CostModel(alpha=50e-6, beta=1e-9, overlap=0.5)) == [[0, 1, 2]]


def test_a_slower_network_makes_bigger_groups():
    slow_start = CostModel(alpha=2e-3, beta=1e-9)  # 2 ms per message: 8 MB before a group is bandwidth-bound
    assert cut([[300 * K]] * 6, slow_start) == [list(range(6))]


@pytest.mark.parametrize("seed", range(40))
def test_every_rule_keeps_order_contiguity_and_the_bound(seed):
    """On random layer lists: each tensor in exactly one group, groups contiguous in backprop
    order; a group over the bound ends with a tensor over it (rule d); a cut inside a layer is a
    byte-bound cut (rule c)."""
    rng = random.Random(seed)
    layers = [[rng.choice([40, 2 * K, 60 * K, 300 * K, 1 * MIB, 5 * MIB]) for _ in range(rng.randint(1, 3))]
              for _ in range(rng.randint(1, 12))]
    sizes, names = layer_list(*layers)
    order = list(range(len(sizes)))
    rng.shuffle(order)  # any production order
    model = CostModel(alpha=50e-6, beta=1e-9, overlap=rng.choice([0.0, 0.3, 1.0]))
    threshold = rng.choice([1 * MIB, 4 * MIB])
    groups = _cut_when_bandwidth_bound(order, sizes, model, threshold, names)
    assert [i for g in groups for i in g] == order
    for g, following in zip(groups, groups[1:] + [None]):
        total = sum(sizes[i] for i in g)
        assert total <= threshold or sizes[g[-1]] > threshold, (g, total)
        if following and names[g[-1]] == names[following[0]]:
            assert total + sizes[following[0]] > threshold, (g, following)


def test_describe_names_each_group_and_says_when_autotune_may_merge_them(monkeypatch):
    plan = Plan([Group([1, 0], ["d/bias", "d/kernel"], 40), Group([2], ["e/kernel"], 400)], [1, 0, 2],
                "test", 4 * MIB, MODEL, name="DistributedAdam")
    monkeypatch.delenv("TF_MPI_AUTOTUNE", raising=False)
    text = plan.describe()
    assert "  group 0 (DistributedAdam.group0): 40 B, 2 tensors: d/bias, d/kernel" in text, text
    assert "  group 1 (DistributedAdam.group1): 400 B, 1 tensors: e/kernel" in text, text
    assert plan.collective_name(1) == "DistributedAdam.group1"
    assert "holdback" not in text
    for setting in ("plan", "1"):
        monkeypatch.setenv("TF_MPI_AUTOTUNE", setting)
        assert "rank 0's holdback may send consecutive groups as one message" in plan.describe()
        assert "effective plan: " in plan.describe()
    monkeypatch.setenv("TF_MPI_AUTOTUNE", "0")
    assert "holdback" not in plan.describe()


# ----------------------------------------------------------------------------- the benchmark models

# MLP 784-512-512-10 in backprop order: out/bias, out/kernel, d2/bias, d2/kernel, d1/bias, d1/kernel.
MLP = [40, 20480, 2048, 1048576, 2048, 1605632]
# The LSTM text classifier in backprop order, as make_plan sees it (sparse_as_dense).
LSTM_NAMES = ["dense/bias", "dense/kernel", "lstm_1/lstm_cell/kernel", "lstm_1/lstm_cell/recurrent_kernel",
              "lstm_1/lstm_cell/bias", "lstm/lstm_cell/kernel", "lstm/lstm_cell/recurrent_kernel",
              "lstm/lstm_cell/bias", "embedding/embeddings"]
LSTM = [4, 512, 262144, 262144, 2048, 262144, 262144, 2048, 10_240_000]
# The CNN's last tensors in backprop order: the last blocks' kernels, then the stem conv and its batch norm.
CNN_LAST = [150_000, 150_968, 9216, 1728, 256]


def lstm_layers():
    return [layer_of(n) for n in LSTM_NAMES]


def test_layer_of_drops_the_last_path_part():
    assert layer_of("sequential/lstm_1/lstm_cell/kernel") == "sequential/lstm_1/lstm_cell"
    assert layer_of("dense/kernel:0") == "dense"
    assert layer_of("scale") == "scale"


def test_mlp_sends_its_first_megabyte_early():
    # Rules a and d: the last layer's small tensors join d2/kernel; that group (1 MB) is sent
    # while d1 is still being differentiated. One 2.7 MB group would wait for all.
    assert _cut_when_bandwidth_bound(range(6), MLP, MODEL, 4 * MIB) == [[0, 1, 2, 3], [4, 5]]
    # Rules c and d with a 1 MiB bound: d2/kernel does not fit beside the 22 kB before it;
    # d1/bias (2 kB) rides with the 1.6 MB d1/kernel rather than being a message of its own.
    assert _cut_when_bandwidth_bound(range(6), MLP, MODEL, MIB) == [[0, 1, 2], [3], [4, 5]]
    assert _cut_when_bandwidth_bound(range(6), MLP, NO_OVERLAP, 4 * MIB) == [list(range(6))]


def test_lstm_cut_at_layer_ends_and_its_bias_rides_with_the_embedding():
    # Rule d: the 2 KiB bias before the 10 MB embedding is not a message of its own.
    assert _cut_when_bandwidth_bound(range(4), [524_804, 526_336, 2048, 10_240_000], MODEL, 4 * MIB) \
        == [[0], [1], [2, 3]]
    # Rule b: tensor by tensor, each 256 KiB kernel would be a message of its own (5 groups),
    # although both kernels of a layer are ready at once.
    assert len(_cut_when_bandwidth_bound(range(9), LSTM, MODEL, 4 * MIB)) == 5
    assert _cut_when_bandwidth_bound(range(9), LSTM, MODEL, 4 * MIB, lstm_layers()) == [[0, 1, 2, 3, 4], [5, 6, 7],
                                                                                          [8]]
    assert _cut_when_bandwidth_bound(range(9), LSTM, NO_OVERLAP, 4 * MIB, lstm_layers()) == [list(range(9))]


def test_lstm_plan_does_not_depend_on_probe_noise():
    # The start-up probes put "bandwidth-bound" anywhere between ~190 and ~390 kB on a shared
    # 2-core machine; with layers as the unit, the plan is the same across that range.
    plans = {repr(_cut_when_bandwidth_bound(range(9), LSTM, CostModel(alpha=a * 1e-6, beta=1e-9), 4 * MIB,
                                            lstm_layers()))
             for a in (48, 60, 80, 97)}
    assert len(plans) == 1


def test_cnn_last_layers_join_the_group_before_them():
    # Rule e: the stem conv and its batch norm (11 kB) come after a cut, at the very end of backprop.
    assert _cut_when_bandwidth_bound(range(5), CNN_LAST, MODEL, 4 * MIB) == [[0, 1, 2, 3, 4]]


def test_order_is_kept_and_every_tensor_is_in_exactly_one_group():
    order = [5, 3, 1, 0, 2, 4]
    groups = _cut_when_bandwidth_bound(order, MLP, MODEL, 4 * MIB)
    assert [i for g in groups for i in g] == order
