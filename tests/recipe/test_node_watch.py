"""The head's node watch (verl_patches/launch/node_watch.py): the step a loss happened in, from the run
report's lines in the trainer's log as Ray prints them. The watch itself runs in
tests/recipe/test_multinode_rehearsal.py and test_multinode_node_loss.py against a real Ray cluster of two network namespaces."""

from verl_patches.launch.node_watch import last_step, step_phrase

PREFIX = "\x1b[36m(TaskRunner pid=4886)\x1b[0m "


def test_the_step_comes_from_the_reports_last_line(tmp_path):
    log = tmp_path / "trainer.log"
    assert step_phrase(None) == "before the first training step finished"
    assert step_phrase(log) == "before the first training step finished"  # no log yet
    log.write_text(PREFIX + "Total training steps: 12\n")  # verl's line before the first step
    assert step_phrase(log) == "during step 1/12 (last completed step: 0)"
    log.write_text(PREFIX + "step 0/12 | deepscaler/reward/mean@1 0.000\n" + PREFIX + "Training Progress:   0%\n")
    assert last_step(log) == (0, 12)
    assert step_phrase(log) == "during step 1/12 (last completed step: 0)"
    log.write_text(log.read_text() + PREFIX + "step 1/12 | reward 0.094 | gen 6.4s | step 10.7s\n"
                   + PREFIX + "a line that says step 9/12 without the report's bar\n")
    assert step_phrase(log) == "during step 2/12 (last completed step: 1)"
    log.write_text(log.read_text() + PREFIX + "step 12/12 | reward 0.6\n")
    assert step_phrase(log) == "after the last step (12/12)"
