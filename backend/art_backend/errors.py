"""The errors a request can meet that are not bugs, and the HTTP answer each one is.

Every such error is a `ServiceError`: its class says the answer's status and, in OpenAI's error
shape (`error_body`), its `type` and `param`; the message is the error's own words. So
`server.py` answers them all with one handler, and a new kind of refusal needs only a class here.
Each also keeps the builtin base it has always had (ValueError, LookupError, RuntimeError):
code catches them by it (an `except ValueError` around an engine call, a template, a checkpoint).
This module imports nothing from the backend, so any of its modules can raise these.

    class                         status  type                      param
    ServiceError                     500  InternalServerError       -
    ├── UnsupportedFeatureError      400  BadRequestError           -         a field this server does not do
    ├── ChatFormatError              400  BadRequestError           -         messages or tools that do not render
    ├── GrammarError                 400  BadRequestError           -         a structure that cannot be enforced
    ├── InvalidSamplingError         400  BadRequestError           -         sampling the engine refuses
    ├── ContextLengthError           400  BadRequestError           messages  a prompt longer than the model takes
    ├── ModelNotServedError          404  NotFoundError             model     a model name no one serves
    ├── TrainingRequestError         400  BadRequestError           -         a training call that cannot be done
    ├── UnknownModelError            404  NotFoundError             name      a model never registered
    ├── BaseModelMismatchError       409  ConflictError             -         a model trained on another base
    ├── DamagedCheckpointError       409  ConflictError             -         a checkpoint that does not load
    ├── SyncRefused                  400  BadRequestError           -         a push or pull these files cannot do
    ├── StorageError                 502  StorageError              url       the object store failed or refused
    └── ExportError                  400  BadRequestError           -         an export refused or failed
        └── ExportSpaceError         507  InsufficientStorageError  out       the disk filled up while exporting
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


# ----- serving: what a chat, text completion or Responses request asks --------------------


class UnsupportedFeatureError(ServiceError, ValueError):
    """A request asks for something this server does not do (the message names it)."""

    status_code = 400
    error_type = "BadRequestError"


class ChatFormatError(ServiceError, ValueError):
    """A request's messages, tools, tool_choice or template arguments cannot be rendered."""

    status_code = 400
    error_type = "BadRequestError"


class GrammarError(ServiceError, ValueError):
    """A required tool call or `response_format` asks for a structure that cannot be enforced."""

    status_code = 400
    error_type = "BadRequestError"


class InvalidSamplingError(ServiceError, ValueError):
    """Sampling settings the engine refuses (the message says which and why): a 400, not a 500."""

    status_code = 400
    error_type = "BadRequestError"


class ContextLengthError(ServiceError, ValueError):
    """A prompt (with the completion asked for) longer than the model's context, in OpenAI's words."""

    status_code = 400
    error_type = "BadRequestError"
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


class ModelNotServedError(ServiceError, LookupError):
    """A request names a model this backend does not serve (a 404 before any streaming starts)."""

    status_code = 404
    error_type = "NotFoundError"
    param = "model"

    @classmethod
    def unknown(cls, model: str, served: list[str]) -> ModelNotServedError:
        """OpenAI's words, and the names that would have worked."""
        return cls(f"The model `{model}` does not exist. Served models: {', '.join(served)}.")


# ----- training: /v1/training -------------------------------------------------------------


class TrainingRequestError(ServiceError, ValueError):
    """A training call that cannot be done as asked (a bad name, a scored-only model, no data)."""

    status_code = 400
    error_type = "BadRequestError"


class UnknownModelError(ServiceError, LookupError):
    """A training call names a model not registered on this backend."""

    status_code = 404
    error_type = "NotFoundError"
    param = "name"


class BaseModelMismatchError(ServiceError, ValueError):
    """A model asked to be trained on a base this backend does not serve (a 409: the backend's state, not
    the request, is what differs)."""

    status_code = 409
    error_type = "ConflictError"


class DamagedCheckpointError(ServiceError, ValueError):
    """A stored checkpoint does not load: the model cannot continue from it as it is (a 409: the
    stored files, not the request, are at fault)."""

    status_code = 409
    error_type = "ConflictError"


class SyncRefused(ServiceError, ValueError):
    """What was asked cannot be done with these files (a step the store lacks, a LoRA that differs)."""

    status_code = 400
    error_type = "BadRequestError"


class StorageError(ServiceError, RuntimeError):
    """The object store failed or refused (credentials, bucket, network): its own words, and where.
    A 502: another server, not this one or the request, failed."""

    status_code = 502
    error_type = "StorageError"
    param = "url"


# ----- export -----------------------------------------------------------------------------


class ExportError(ServiceError, ValueError):
    """The export was refused or failed; nothing was left at the target. The message says why and what to do."""

    status_code = 400
    error_type = "BadRequestError"


class ExportSpaceError(ExportError):
    """The disk filled up while writing the export (nothing was left at the target): a 507, so a
    client can tell a full disk, which freeing space fixes, from a refused export."""

    status_code = 507
    error_type = "InsufficientStorageError"
    param = "out"
