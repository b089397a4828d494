"""A request's end flag: threading.Event's behaviour, its Event made only for a caller that waits."""

import threading

from transduce.serve.requests import Ended


def test_a_waiter_before_the_end_is_woken_and_one_after_returns_at_once():
    ended = Ended()
    assert not ended.is_set() and ended.wait(0.01) is False  # a timeout: False, as Event.wait
    woken = []
    waiter = threading.Thread(target=lambda: woken.append(ended.wait(30)))
    waiter.start()
    while ended._event is None:  # the waiter made the Event
        threading.Event().wait(0.001)
    ended.set()
    waiter.join(30)
    assert woken == [True] and ended.is_set() and ended.wait(0) is True


def test_setting_and_reading_the_end_make_no_event():
    ended = Ended()
    ended.set()
    assert ended.is_set() and ended.wait() is True and ended._event is None
