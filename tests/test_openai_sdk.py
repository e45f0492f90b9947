"""The server's events as the official `openai` SDK sees them: every event type is either one of the OpenAI
Realtime API's server events (the SDK's own union) or the runtime's own, under the `runtime.` prefix, so no
client takes an extension for an OpenAI type (docs/protocol.md). Issue 24 grows this into conversations held
through `client.realtime.connect`."""

from __future__ import annotations

import inspect
import typing

from openai.types.realtime import RealtimeServerEvent

from runtime import events


def sdk_types() -> set[str]:
    union = typing.get_args(RealtimeServerEvent)[0]  # Annotated[Union[...], discriminator]
    return {lit for member in typing.get_args(union) for lit in typing.get_args(member.model_fields["type"].annotation)}


def our_types() -> set[str]:
    return {cls.type for _, cls in inspect.getmembers(events, inspect.isclass)
            if issubclass(cls, events.Event) and cls is not events.Event}


def test_every_server_event_is_the_sdks_or_namespaced() -> None:
    known = sdk_types()
    assert len(known) > 30 and "response.output_text.delta" in known  # the SDK's union was read
    ours = our_types()
    assert {"runtime.metrics", "runtime.video.note", "response.output_text.delta"} <= ours
    stray = sorted(t for t in ours if t not in known and not t.startswith("runtime."))
    assert stray == [], f"event types neither OpenAI's nor under runtime.: {stray}"
    assert not [t for t in ours if t.startswith("runtime.") and t in known]
