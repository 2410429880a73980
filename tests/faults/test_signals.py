import os
import signal
import threading

from spmd_engine.faults.signals import install_signal_thread


def test_a_signal_is_handled_on_the_signal_thread_and_uninstall_restores():
    got = []
    done = threading.Event()

    def on_signal(signum):
        got.append((signum, threading.current_thread().name))
        done.set()

    before = signal.getsignal(signal.SIGUSR1)
    state = install_signal_thread(on_signal, signals=(signal.SIGUSR1,))
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert done.wait(5)
    finally:
        state.uninstall()
    assert got == [(signal.SIGUSR1, "spmd-signals")]
    assert signal.getsignal(signal.SIGUSR1) == before and not state.thread.is_alive()
