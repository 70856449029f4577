import torch

from graphs.memory import MemoryTracker, SavedTensorCounter, measure_peak


def test_peak_counts_temporaries_and_baseline():
    x = torch.ones(1000)
    tracker = measure_peak(lambda t: ((t + 1) * 2).sum(), x)
    # x, t + 1, and (t + 1) * 2 are alive together at the peak
    assert tracker.baseline_bytes == 4000
    assert tracker.peak_bytes == 12000


def test_views_are_counted_once():
    x = torch.ones(1000)
    with MemoryTracker(x) as tracker:
        y = x.view(10, 100).t()
        z = y[0]
    assert tracker.peak_bytes == 4000
    del y, z


def test_freed_tensors_leave_the_count():
    with MemoryTracker() as tracker:
        for _ in range(5):
            a = torch.ones(1000)
            del a
    assert tracker.peak_bytes == 4000
    assert tracker.current_bytes == 0


def test_training_step_includes_grads():
    lin = torch.nn.Linear(100, 100, bias=False)
    x = torch.randn(10, 100)
    with MemoryTracker(lin, x) as tracker:
        lin(x).sum().backward()
    assert tracker.current_bytes >= tracker.baseline_bytes + 100 * 100 * 4  # the weight's grad
    # the output (10 x 100) is alive during forward; the weight's grad after backward
    assert tracker.peak_bytes >= tracker.baseline_bytes + 100 * 100 * 4
    assert tracker.peak_bytes < tracker.baseline_bytes + 2 * 100 * 100 * 4


def test_saved_counter_dedups_and_excludes_params():
    lin = torch.nn.Linear(16, 16)
    x = torch.randn(8, 16, requires_grad=True)
    with SavedTensorCounter(lin) as saved:
        h = torch.relu(lin(x))
        y = h * h  # saves h twice: counted once
    assert saved.bytes == 8 * 16 * 4 * 2  # x (input of the matmul) and h
    y.sum().backward()
