"""The errors a request can meet that are not bugs, and the HTTP answer each one is.

Every such error is a `ServiceError`: its class says the answer's status and, in OpenAI's error
shape (`error_body`), its `type` and `param`; the message is the error's own words. So
`server.py` answers them all with one handler, and a new kind of refusal needs only a class here.
Each also keeps the builtin base it has always had (ValueError, LookupError, RuntimeError):
code catches them by it (an `except ValueError` around an engine call, a template, a checkpoint).
This module imports nothing from the backend, so any of its modules can raise these.

    class                         status  type                      param
    ServiceError                     500  InternalServerError       -
    ├── BadRequestError              400  BadRequestError           -         the request cannot be done as asked
    │   ├── UnsupportedFeatureError  400  BadRequestError           -         a field this server does not do
    │   ├── ChatFormatError          400  BadRequestError           -         messages or tools that do not render
    │   ├── GrammarError             400  BadRequestError           -         a structure that cannot be enforced
    │   ├── InvalidSamplingError     400  BadRequestError           -         sampling the engine refuses
    │   ├── ContextLengthError       400  BadRequestError           messages  a prompt longer than the model takes
    │   ├── TrainingRequestError     400  BadRequestError           -         a training call that cannot be done
    │   ├── SyncRefused              400  BadRequestError           -         a push or pull these files cannot do
    │   └── ExportError              400  BadRequestError           -         an export refused or failed
    │       └── ExportSpaceError     507  InsufficientStorageError  out       the disk filled up while exporting
    ├── NotFoundError                404  NotFoundError             -         a name this backend does not know
    │   ├── ModelNotServedError      404  NotFoundError             model     a model name no one serves
    │   └── UnknownModelError        404  NotFoundError             name      a model never registered
    ├── ConflictError                409  ConflictError             -         the backend's state, not the request
    │   ├── BaseModelMismatchError   409  ConflictError             -         a model trained on another base
    │   └── DamagedCheckpointError   409  ConflictError             -         a checkpoint that does not load
    └── StorageError                 502  StorageError              url       the object store failed or refused

    ModelNotFoundError (RuntimeError): the model to serve cannot be found or loaded, met at start
    (and by the viewer and export, which load a model too), before anything is answered.
"""

from __future__ import annotations

from typing import Any, ClassVar


def error_body(message: str, type_: str, param: str | None = None, code: int | str | None = None) -> dict[str, Any]:
    """An error answer in OpenAI's shape, which its SDKs (and the client's capture) read."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class ServiceError(Exception):
    """An error answered as its class says (`status_code`, `error_type`, `param`), in its own words.
    One that says nothing else is the server's fault: a 500, as an unexpected error is."""

    status_code: ClassVar[int] = 500
    error_type: ClassVar[str] = "InternalServerError"
    param: ClassVar[str | None] = None  # the request field at fault, where the answer names one

    def body(self) -> dict[str, Any]:
        """The answer's JSON body (its status repeated as `code`, as OpenAI's errors carry it)."""
        return error_body(str(self), self.error_type, self.param, self.status_code)


class BadRequestError(ServiceError, ValueError):
    """A request that cannot be done as asked (the message says why and what to do instead)."""

    status_code = 400
    error_type = "BadRequestError"


class NotFoundError(ServiceError, LookupError):
    """A request names something this backend does not know (`param` says which field)."""

    status_code = 404
    error_type = "NotFoundError"


class ConflictError(ServiceError, ValueError):
    """The backend's stored state, not the request, stands in the way."""

    status_code = 409
    error_type = "ConflictError"


# ----- serving: what a chat, text completion or Responses request asks --------------------


class UnsupportedFeatureError(BadRequestError):
    """A request asks for something this server does not do (the message names it)."""


class ChatFormatError(BadRequestError):
    """A request's messages, tools, tool_choice or template arguments cannot be rendered."""


class GrammarError(BadRequestError):
    """A required tool call or `response_format` asks for a structure that cannot be enforced."""


class InvalidSamplingError(BadRequestError):
    """Sampling settings the engine refuses (the message says which and why): a 400, not a 500."""


class ContextLengthError(BadRequestError):
    """A prompt (with the completion asked for) longer than the model's context, in OpenAI's words."""

    param = "messages"

    @classmethod
    def over(cls, limit: int, prompt_tokens: int, completion_tokens: int) -> ContextLengthError:
        """OpenAI's own words, so clients that read them (to trim a conversation, say) read ours."""
        return cls(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the messages, {completion_tokens} "
            "in the completion). Shorten the messages or lower max_tokens."
        )

    @classmethod
    def text_over(cls, limit: int, characters: int) -> ContextLengthError:
        """Said before tokenizing: the text is longer than `limit` tokens of the longest can hold."""
        return cls(f"This model's maximum context length is {limit} tokens. However, the messages are {characters} "
                   f"characters, more than {limit} tokens can hold. Shorten the messages.")


class ModelNotServedError(NotFoundError):
    """A request names a model this backend does not serve (a 404 before any streaming starts)."""

    param = "model"

    @classmethod
    def unknown(cls, model: str, served: list[str]) -> ModelNotServedError:
        """OpenAI's words, and the names that would have worked."""
        return cls(f"The model `{model}` does not exist. Served models: {', '.join(served)}.")


# ----- training: /v1/training -------------------------------------------------------------


class TrainingRequestError(BadRequestError):
    """A training call that cannot be done as asked (a bad name, a scored-only model, no data)."""


class UnknownModelError(NotFoundError):
    """A training call names a model not registered on this backend."""

    param = "name"


class BaseModelMismatchError(ConflictError):
    """A model asked to be trained on a base this backend does not serve (a 409: the backend's state, not
    the request, is what differs)."""


class DamagedCheckpointError(ConflictError):
    """A stored checkpoint does not load: the model cannot continue from it as it is (a 409: the
    stored files, not the request, are at fault)."""


class SyncRefused(BadRequestError):
    """What was asked cannot be done with these files (a step the store lacks, a LoRA that differs)."""


class StorageError(ServiceError, RuntimeError):
    """The object store failed or refused (credentials, bucket, network): its own words, and where.
    A 502: another server, not this one or the request, failed."""

    status_code = 502
    error_type = "StorageError"
    param = "url"


# ----- export -----------------------------------------------------------------------------


class ExportError(BadRequestError):
    """The export was refused or failed; nothing was left at the target. The message says why and what to do."""


class ExportSpaceError(ExportError):
    """The disk filled up while writing the export (nothing was left at the target): a 507, so a
    client can tell a full disk, which freeing space fixes, from a refused export."""

    status_code = 507
    error_type = "InsufficientStorageError"
    param = "out"


# ----- starting: the model to serve (not an answer: the command that starts ends with it) ------


class ModelNotFoundError(RuntimeError):
    """The model to serve is not where it was looked for, or does not load; the message names it and the fix."""
