"""``remat.meters.memory``: the live-tensor tracker and ``remat.measure`` against byte counts worked out by hand, for
hand-made allocation sequences and for a real training step; what creates a storage and what does not, marks,
pausing, the device filter, nesting, and teardown when the measured code raises. The CUDA allocator path is
tested in test_gpu.py."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _len_torch_dispatch_stack

import remat
from remat.meters import LiveTensorTracker, MemoryReport

KIB = 1024


# ---------------------------------------------------------------- the tracker


def test_tracker_peak_and_timeline_of_a_known_allocation_sequence() -> None:
    tracker = LiveTensorTracker()
    with tracker:
        survivor = torch.empty(1000, dtype=torch.uint8)  # +1000, alive after the region
        a = torch.empty(1024, dtype=torch.float32)  # +4096
        b = torch.empty(2048, dtype=torch.float32)  # +8192
        del a  # -4096
        c = torch.empty(512, dtype=torch.float64)  # +4096
        del b, c  # -8192, -4096
    tracker.close()
    assert tracker.timeline(exclude_survivors=False) == [0, 1000, 5096, 13288, 9192, 13288, 5096, 1000]
    assert tracker.timeline() == [0, 0, 4096, 12288, 8192, 12288, 4096, 0]
    assert tracker.peak(exclude_survivors=False) == tracker.peak_live_bytes == 13288
    assert tracker.peak() == 12288
    assert len(tracker.survivors) == 1 and tracker.live_bytes == 1000
    assert survivor.numel() == 1000


class NamingTracker(LiveTensorTracker):
    """Notes each tracked storage's event id with its tensor's element count (the ``allocated`` hook)."""

    def __init__(self) -> None:
        super().__init__()
        self.numel: dict[int, int] = {}

    def allocated(self, event_id: int, t: torch.Tensor) -> None:
        self.numel[event_id] = t.numel()


def test_the_allocations_alive_at_the_peak_are_named_by_the_hook_and_leave_out_survivors() -> None:
    tracker = NamingTracker()
    with tracker:
        survivor = torch.empty(1000, dtype=torch.uint8)
        a = torch.empty(1024, dtype=torch.float32)
        b = torch.empty(2048, dtype=torch.float32)
        del a
        c = torch.empty(768, dtype=torch.float64)  # the peak: b and c, above a and b (and the survivor, left out)
        del b
        d = torch.empty(16, dtype=torch.float32)
        del c, d
    tracker.close()
    assert sorted(tracker.numel.values()) == [16, 768, 1000, 1024, 2048]  # every storage, through the hook
    at_peak = tracker.alive_at_peak()
    assert sorted(tracker.numel[i] for i in at_peak) == [768, 2048]
    assert sorted(tracker.numel[i] for i in tracker.alive_at_peak(exclude_survivors=False)) == [768, 1000, 2048]
    assert tracker.peak() == 2048 * 4 + 768 * 8
    assert survivor.numel() == 1000


def test_views_in_place_results_and_detach_create_no_storage_but_every_output_does() -> None:
    tracker = LiveTensorTracker()
    with tracker:
        x = torch.randn(100)  # +400
        values, indices = torch.sort(x)  # two new storages: +400 float32 values, +800 int64 indices
        views = (x.view(10, 10), x[3:7], x.detach(), x.add_(1))
    tracker.close()
    assert tracker.timeline(exclude_survivors=False) == [0, 400, 800, 1600]
    assert values.numel() == indices.numel() == 100 and len(views) == 4


def test_tracker_marks_and_pause() -> None:
    tracker = LiveTensorTracker()
    with tracker:
        a = torch.empty(256, dtype=torch.uint8)
        tracker.mark("one")
        with tracker.paused():
            ignored = torch.empty(10_000, dtype=torch.uint8)
        b = torch.empty(512, dtype=torch.uint8)
        tracker.mark("two")
        del a
        tracker.mark("three")
        del b
    tracker.close()
    assert [tracker.bytes_at(k) for k in ("one", "two", "three")] == [256, 768, 512]
    assert tracker.peak_between("one", "three") == 768
    with pytest.raises(KeyError, match="no mark named 'four'"):
        tracker.bytes_at("four")
    assert ignored.numel() == 10_000


def test_tracker_counts_only_its_device() -> None:
    on_meta = LiveTensorTracker("meta")
    with on_meta:
        cpu = torch.empty(1000, dtype=torch.uint8)
        meta = torch.empty(100, device="meta")
    on_meta.close()
    assert on_meta.timeline(exclude_survivors=False) == [0, 400]
    on_cuda = LiveTensorTracker("cuda")
    with on_cuda:
        cpu_too = torch.empty(1000, dtype=torch.uint8)
    on_cuda.close()
    assert on_cuda.peak(exclude_survivors=False) == 0
    assert cpu.numel() == cpu_too.numel() == 1000 and meta.numel() == 100


# ---------------------------------------------------------------- remat.measure


def test_measure_a_known_allocation_pattern() -> None:
    kept_outside = torch.zeros(100)
    with remat.measure() as m:
        survivor = torch.empty(3000, dtype=torch.uint8)  # outlives the region
        view = kept_outside[10:20]  # a view creates no storage
        kept_outside.add_(1)  # nor does an in-place op on a tensor from outside
        a = torch.empty(1024, dtype=torch.float32)  # 4 KiB
        b = torch.empty(2048, dtype=torch.float32)  # 8 KiB: 12 KiB alive
        del a
        c = torch.empty(512, dtype=torch.float64)  # 4 KiB: 12 KiB alive
        d = torch.empty(4096, dtype=torch.uint8)  # 4 KiB: 16 KiB alive, the peak
        del b, c, d
    assert m.activation_bytes == 16 * KIB  # what died inside the region
    assert m.peak_bytes == 16 * KIB + 3000  # everything created inside, survivors included
    assert m.timeline[0] == 0 and max(m.timeline) == 16 * KIB and m.timeline[-1] == 0
    assert m.device == "cpu" and m.source == "tracker"
    assert survivor.numel() == 3000 and view.numel() == 10


def test_measure_an_empty_region() -> None:
    with remat.measure() as m:
        pass
    assert m.activation_bytes == 0 and m.peak_bytes == 0


def test_measure_a_training_step_reads_its_saved_activations_and_gradients() -> None:
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)  # from outside the region: saved by the linear layer, not counted
    with remat.measure() as m:
        h = lin(x).relu()
        h.sum().backward()
        del h
    out = 64 * 256 * 4  # one 64 x 256 float32 activation: 64 KiB
    # Peak of what dies inside: the relu output (saved for backward) and the incoming gradient of the same size
    # alive together in relu's backward, plus the 4-byte loss and the 4-byte gradient that starts backward.
    assert m.activation_bytes == 2 * out + 2 * 4
    # Everything created inside adds the parameter gradients, which outlive the step.
    assert m.peak_bytes == m.activation_bytes + lin.weight.numel() * 4 + lin.bias.numel() * 4
    assert lin.weight.grad is not None and lin.bias.grad is not None


def test_measure_without_the_tracker_option_still_tracks_on_cpu() -> None:
    with remat.measure(tracker=False) as m:
        a = torch.empty(1000, dtype=torch.uint8)
        del a
    assert m.source == "tracker" and m.peak_bytes == m.activation_bytes == 1000


def test_nested_measures_both_see_the_inner_allocations() -> None:
    with remat.measure() as outer:
        a = torch.empty(1000, dtype=torch.uint8)
        with remat.measure() as inner:
            b = torch.empty(500, dtype=torch.uint8)
            del b
        del a
    assert (inner.peak_bytes, inner.activation_bytes) == (500, 500)
    assert (outer.peak_bytes, outer.activation_bytes) == (1500, 1500)


def test_measure_leaves_no_mode_behind_when_the_region_raises() -> None:
    with pytest.raises(RuntimeError, match="inside the region"), remat.measure() as report:
        a = torch.empty(2048, dtype=torch.uint8)
        del a
        raise RuntimeError("inside the region")
    assert _len_torch_dispatch_stack() == 0
    assert isinstance(report, MemoryReport) and report.peak_bytes == report.activation_bytes == 2048
    with remat.measure() as after:  # and the next measurement starts from scratch
        b = torch.empty(10, dtype=torch.uint8)
        del b
    assert after.peak_bytes == 10


def test_a_tracker_left_before_one_entered_inside_it_leaves_only_itself() -> None:
    """A profiler's tracker entered inside the user's ``remat.measure()`` (PGAC's first step) is still active when
    the user's ends: the user's leaves the stack, the profiler's stays until it exits."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from remat.meters import LiveTensorTracker

    before = list(_get_current_dispatch_mode_stack())
    outer, inner = LiveTensorTracker(), LiveTensorTracker()
    outer.__enter__()
    inner.__enter__()
    torch.ones(16)
    outer.__exit__(None, None, None)
    assert [m for m in _get_current_dispatch_mode_stack() if m not in before] == [inner]
    inner.exit_anywhere()
    assert list(_get_current_dispatch_mode_stack()) == before
