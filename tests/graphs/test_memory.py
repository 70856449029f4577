import pytest
import torch

from examples.models import inplace_mlp, unet
from graphs import RematError
from graphs.memory import AllocatorPeak, MemoryTracker, SavedTensorCounter, measure_peak, peak_of_events


def test_peak_counts_temporaries_and_baseline():
    x = torch.ones(1000)
    m = measure_peak(lambda t: ((t + 1) * 2).sum(), x, track=True)
    # x, t + 1, and (t + 1) * 2 are alive together at the peak
    assert m.baseline_bytes == 4000
    assert m.tracked_peak_bytes == 12000
    # the allocator also sees the small tensors that wrap the Python scalars 1 and 2
    assert 12000 < m.peak_bytes <= 12000 + 64
    assert m.result.item() == pytest.approx(4000.0)


def test_allocator_peak_of_one_empty_tensor_is_exact():
    x = torch.ones(300)
    with AllocatorPeak(x) as m:
        y = torch.empty(1000)  # the CPU allocator reports the bytes asked for: no rounding
    assert m.baseline_bytes == 1200
    assert m.peak_bytes - m.baseline_bytes == 4000
    assert m.allocated_bytes == 4000  # y survives the block
    del y


def test_allocator_peak_counts_temporaries_that_are_freed():
    with AllocatorPeak() as m:
        for n in (1000, 3000, 2000):
            a = torch.empty(n)
            del a
    assert m.peak_bytes == 12000 and m.allocated_bytes == 0


def test_roots_count_once_per_storage_on_the_judged_device():
    lin = torch.nn.Linear(10, 10)
    x = torch.randn(4, 10)
    lin.weight.grad = torch.zeros(10, 10)
    with AllocatorPeak(lin, [x, x.view(-1), x[1:]], torch.empty(5, device="meta")) as m:
        pass
    assert m.baseline_bytes == (100 + 10 + 100 + 40) * 4
    assert m.peak_bytes == m.baseline_bytes and m.device == torch.device("cpu")


def test_the_allocator_sees_what_a_convolution_allocates_inside_the_op():
    conv = torch.nn.Conv2d(8, 16, 3, padding=1)
    x = torch.randn(4, 8, 32, 32)
    with torch.no_grad(), AllocatorPeak(conv, x, track=True) as m:
        y = conv(x)
    out = y.numel() * 4
    assert m.tracked_peak_bytes == m.baseline_bytes + out  # the tracker sees the output only
    assert m.peak_bytes > m.tracked_peak_bytes
    assert m.allocated_bytes == out


def test_a_cnn_step_allocates_more_than_the_live_tensor_tracker_sees():
    model, (x,) = unet(batch=4, size=32)
    m = measure_peak(lambda: model(x).sum().backward(), roots=(model, x), track=True)
    assert m.baseline_bytes == sum(p.numel() * 4 for p in model.parameters()) + x.numel() * 4
    # measured: 2.00 MiB by the allocator, 1.50 MiB by the tracker (conv kernels' buffers)
    assert m.peak_bytes >= 1.2 * m.tracked_peak_bytes


def test_the_judge_cannot_run_inside_another_profiler():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with pytest.raises(RematError, match="outside any other torch.profiler"):
            with AllocatorPeak():
                pass


def test_peak_of_events_is_the_highest_running_total():
    assert peak_of_events([]) == (0, 0)
    assert peak_of_events([5, -5, 3, 4, -7, 1]) == (7, 1)


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


def test_the_verdict_is_measured_without_the_tracker():
    def step():
        model(x).backward()

    model, (x,) = inplace_mlp()
    alone = measure_peak(step, roots=(model, x))
    model.zero_grad(set_to_none=True)
    tracked = measure_peak(step, roots=(model, x), track=True)
    assert alone.tracked_peak_bytes is None
    # the tracker's references keep autograd from reusing a gradient buffer in place
    assert tracked.peak_bytes == tracked.tracked_peak_bytes > alone.peak_bytes
