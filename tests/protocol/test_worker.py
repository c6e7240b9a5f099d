"""The endpoint's worker thread (protocol/worker.py): messages are decoded off the
endpoint's lock, so a slow or hostile message holds up no other thread."""

from __future__ import annotations

import threading

from tests.protocol.endpoints import (
    OTHER_MESH,
    RawPeer,
)


def test_messages_are_decoded_without_holding_the_endpoint_lock(context, make_endpoint):
    endpoint = make_endpoint("target")
    endpoint.start()
    lock_free_while_decoding: list[bool] = []
    decode = endpoint.decoder.decode

    def try_the_lock() -> None:
        taken = endpoint.lock.acquire(timeout=0.5)
        if taken:
            endpoint.lock.release()
        lock_free_while_decoding.append(taken)

    def observed_decode(frames):
        # Another thread must be able to take the lock while a message is being decoded.
        probe = threading.Thread(target=try_the_lock)
        probe.start()
        probe.join()
        return decode(frames)

    endpoint.decoder.decode = observed_decode
    raw = RawPeer(context, endpoint.contact)
    raw.join()
    raw.send(raw.frames("heartbeat", {}, mesh=OTHER_MESH))  # a rejected one too
    raw.join()
    assert len(lock_free_while_decoding) >= 3 and all(lock_free_while_decoding)
    assert endpoint.rejections() == {"wrong_mesh": 1}
