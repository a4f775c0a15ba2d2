"""The grouping plan's cut rule on known sizes (single process; the plan on a
real model and its agreement across ranks are checked in keras_worker.py)."""
from tf_mpi.grouping import MIN_GROUP_COST_FACTOR, CostModel, _cut_when_bandwidth_bound, layer_of

# alpha 50 us, beta 1 ns/B: break-even 50 kB, so a group is bandwidth-bound from 200 kB.
MODEL = CostModel(alpha=50e-6, beta=1e-9)
MIB = 1 << 20
# MLP 784-512-512-10 in backprop order: out/bias, out/kernel, d2/bias, d2/kernel, d1/bias, d1/kernel.
MLP = [40, 20480, 2048, 1048576, 2048, 1605632]


def test_factor_is_what_the_numbers_below_assume():
    assert MIN_GROUP_COST_FACTOR == 4


def test_small_tensors_ride_with_the_next_large_one_and_large_groups_go_early():
    # The last layer's small tensors join d2/kernel; that group (1 MB) is sent
    # while d1 is still being differentiated. One 2.7 MB group would wait for all.
    assert _cut_when_bandwidth_bound(range(6), MLP, MODEL, 4 * MIB) == [[0, 1, 2, 3], [4, 5]]


def test_the_byte_bound_still_cuts_and_a_big_tensor_takes_the_small_ones_before_it():
    # d2/kernel (exactly 1 MiB) does not fit beside the 22 kB before it: cut. d1/kernel
    # (1.6 MB) is over the bound anyway, so d1/bias (2 kB) rides with it rather than
    # being a message of its own.
    assert _cut_when_bandwidth_bound(range(6), MLP, MODEL, MIB) == [[0, 1, 2], [3], [4, 5]]


def test_a_bandwidth_bound_group_is_not_merged_into_a_big_tensor():
    sizes = [300_000, 2 * MIB]  # the first is already worth a message of its own
    assert _cut_when_bandwidth_bound(range(2), sizes, MODEL, MIB) == [[0], [1]]


def test_lstm_bias_before_the_embedding_is_not_a_group_of_its_own():
    # Backprop order of the LSTM benchmark with sparse_as_dense: ..., lstm/bias, embedding (10 MB).
    sizes = [524_804, 526_336, 2048, 10_240_000]
    assert _cut_when_bandwidth_bound(range(4), sizes, MODEL, 4 * MIB) == [[0], [1], [2, 3]]


def test_latency_bound_model_is_one_group():
    sizes = [4000] * 10  # 40 kB in all: below 200 kB, one message is cheapest
    assert _cut_when_bandwidth_bound(range(10), sizes, MODEL, 4 * MIB) == [list(range(10))]


def test_a_slower_network_makes_bigger_groups():
    slow_start = CostModel(alpha=2e-3, beta=1e-9)  # 2 ms per message: 8 MB before a group is worth sending
    assert _cut_when_bandwidth_bound(range(6), MLP, slow_start, 4 * MIB) == [list(range(6))]


def test_order_is_kept_and_every_tensor_is_in_exactly_one_group():
    order = [5, 3, 1, 0, 2, 4]
    groups = _cut_when_bandwidth_bound(order, MLP, MODEL, 4 * MIB)
    assert [i for g in groups for i in g] == order


# The LSTM benchmark in backprop order, as make_plan sees it (sparse_as_dense).
LSTM_NAMES = ["dense/bias", "dense/kernel", "lstm_1/lstm_cell/kernel", "lstm_1/lstm_cell/recurrent_kernel",
              "lstm_1/lstm_cell/bias", "lstm/lstm_cell/kernel", "lstm/lstm_cell/recurrent_kernel",
              "lstm/lstm_cell/bias", "embedding/embeddings"]
LSTM = [4, 512, 262144, 262144, 2048, 262144, 262144, 2048, 10_240_000]


def test_layer_of_drops_the_last_path_part():
    assert layer_of("sequential/lstm_1/lstm_cell/kernel") == "sequential/lstm_1/lstm_cell"
    assert layer_of("dense/kernel:0") == "dense"
    assert layer_of("scale") == "scale"


def test_a_layer_is_not_cut_where_its_gradients_come_out_together():
    # Bandwidth-bound from 200 kB: tensor by tensor, each 256 KiB LSTM kernel would be a
    # message of its own (5 groups), although both kernels of a layer are ready at once.
    layers = [layer_of(n) for n in LSTM_NAMES]
    assert len(_cut_when_bandwidth_bound(range(9), LSTM, MODEL, 4 * MIB)) == 5
    assert _cut_when_bandwidth_bound(range(9), LSTM, MODEL, 4 * MIB, layers) == [[0, 1, 2, 3, 4], [5, 6, 7], [8]]


def test_the_layer_plan_does_not_depend_on_probe_noise():
    # The start-up probes put "bandwidth-bound" anywhere between ~190 and ~390 kB on this
    # machine; with layers as the unit, the LSTM's plan is the same across that range.
    layers = [layer_of(n) for n in LSTM_NAMES]
    plans = {repr(_cut_when_bandwidth_bound(range(9), LSTM, CostModel(alpha=a * 1e-6, beta=1e-9), 4 * MIB, layers))
             for a in (48, 60, 80, 97)}
    assert len(plans) == 1


def test_a_latency_bound_remainder_at_the_end_joins_the_group_before_it():
    # The CNN benchmark's last layers (the first conv and its batch norm) came after a cut:
    # an 11 kB message of its own at the very end of backprop, with nothing left to overlap.
    sizes = [150_000, 150_968, 9216, 1728, 256]
    assert _cut_when_bandwidth_bound(range(5), sizes, MODEL, 4 * MIB) == [[0, 1, 2, 3, 4]]
    # A bandwidth-bound last group stays on its own, and so does a remainder the byte bound keeps out.
    assert _cut_when_bandwidth_bound(range(6), MLP, MODEL, 4 * MIB) == [[0, 1, 2, 3], [4, 5]]
    assert _cut_when_bandwidth_bound(range(2), [900_000, 9216], MODEL, 900_000) == [[0], [1]]


def test_without_overlap_only_the_byte_bound_cuts():
    # Communication that cannot hide behind backprop (one busy core per rank) gains
    # nothing from an early message: the LSTM and the MLP become one group each.
    shared_core = CostModel(alpha=50e-6, beta=1e-9, overlap=0.0)
    assert _cut_when_bandwidth_bound(range(9), LSTM, shared_core, 4 * MIB, [layer_of(n) for n in LSTM_NAMES]) == [list(range(9))]
    assert _cut_when_bandwidth_bound(range(6), MLP, shared_core, 4 * MIB) == [list(range(6))]
    # The byte bound still holds for a model larger than it.
    assert _cut_when_bandwidth_bound(range(6), [3 * MIB] * 6, shared_core, 4 * MIB) == [[k] for k in range(6)]


def test_partial_overlap_raises_the_bound_by_its_inverse():
    # At overlap 1 a group is worth sending from 200 kB; at 0.5 only half its
    # transfer hides, so it takes 400 kB.
    sizes = [300_000, 300_000, 300_000]
    assert _cut_when_bandwidth_bound(range(3), sizes, MODEL, 4 * MIB) == [[0], [1], [2]]
    half = CostModel(alpha=50e-6, beta=1e-9, overlap=0.5)
    assert _cut_when_bandwidth_bound(range(3), sizes, half, 4 * MIB) == [[0, 1, 2]]
