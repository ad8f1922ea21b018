"""The batch classes CUDA-graph decode steps are captured for (the capture itself: -m gpu)."""

from kvrelay.workers.engine.cuda_graphs import batch_classes


def test_batch_classes_cover_every_batch_up_to_the_maximum():
    assert batch_classes(1) == [1]
    assert batch_classes(5) == [1, 2, 4, 5]
    assert batch_classes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_classes(256) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192,
                                  224, 256]  # fmt: skip
    assert batch_classes(100)[-3:] == [64, 96, 100]
