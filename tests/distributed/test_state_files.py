"""Which process writes which file of the base checkpoint format."""

from cadence.distributed.state_files import file_writers


def test_the_optimizer_file_goes_to_another_process_of_the_main_machine_only():
    assert file_writers(["a"]) == (0, 0)                        # one process writes both
    assert file_writers(["a", "a", "b", "b"]) == (0, 1)         # rank 1 shares rank 0's machine
    assert file_writers(["a", "b", "a", "b"]) == (0, 2)         # ranks dealt round-robin over the machines
    assert file_writers(["a", "b", "c"]) == (0, 0)              # no other process on rank 0's machine: its disk
