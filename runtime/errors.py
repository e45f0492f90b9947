"""Errors a user can act on. The CLI prints their message as one line and exits non-zero; inside a session a
failure becomes an `error` event (its message included) and the session goes on. Anything else is a bug and
keeps its traceback."""

from __future__ import annotations


class UserError(Exception):
    """Base: `str(err)` is a complete one-line message that says what to do."""

    code = "user_error"


class ConfigError(UserError):
    code = "invalid_config"


class CheckpointNotFound(UserError):
    code = "checkpoint_not_found"


class RequestError(UserError):
    """What a session's client asked for and can change (on the wire: an `invalid_request_error`), as opposed to
    the server's own set-up (a missing package, a checkpoint), which a client cannot fix."""


class PromptTooLong(RequestError):
    """A response's question and instructions past what the answerer takes in one go."""

    code = "prompt_too_long"


class InvalidSchema(RequestError):
    """A function's JSON schema the constrained decoder cannot use."""

    code = "invalid_tool_schema"


class MediaError(UserError):
    """A file or device that cannot be opened or decoded."""

    code = "invalid_media"


class DeviceNotFound(MediaError):
    """A camera or microphone that is not there."""

    code = "device_not_found"
