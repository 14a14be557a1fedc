from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Attention(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ATTENTION_UNSPECIFIED: _ClassVar[Attention]
    ATTENTION_ACTIVE: _ClassVar[Attention]
    ATTENTION_IDLE: _ClassVar[Attention]
    ATTENTION_BACKGROUND: _ClassVar[Attention]

class DeviceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DEVICE_UNSPECIFIED: _ClassVar[DeviceKind]
    DEVICE_DESKTOP: _ClassVar[DeviceKind]
    DEVICE_MOBILE: _ClassVar[DeviceKind]
    DEVICE_WEB: _ClassVar[DeviceKind]
    DEVICE_OTHER: _ClassVar[DeviceKind]

class Urgency(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    URGENCY_NORMAL: _ClassVar[Urgency]
    URGENCY_URGENT: _ClassVar[Urgency]

class NotifyReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NOTIFY_REASON_UNSPECIFIED: _ClassVar[NotifyReason]
    NOTIFY_REASON_ROOM_OPEN: _ClassVar[NotifyReason]
    NOTIFY_REASON_ATTENDED_ELSEWHERE: _ClassVar[NotifyReason]
    NOTIFY_REASON_NO_ATTENDED_SESSION: _ClassVar[NotifyReason]
    NOTIFY_REASON_UNKNOWN_FAIL_OPEN: _ClassVar[NotifyReason]
    NOTIFY_REASON_OFFLINE: _ClassVar[NotifyReason]
    NOTIFY_REASON_URGENT: _ClassVar[NotifyReason]

class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    STATE_UNSPECIFIED: _ClassVar[State]
    STATE_OFFLINE: _ClassVar[State]
    STATE_ONLINE: _ClassVar[State]

class Availability(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    AVAILABILITY_UNSPECIFIED: _ClassVar[Availability]
    AVAILABILITY_AVAILABLE: _ClassVar[Availability]
    AVAILABILITY_AWAY: _ClassVar[Availability]
    AVAILABILITY_DO_NOT_DISTURB: _ClassVar[Availability]
    AVAILABILITY_ACTIVE: _ClassVar[Availability]

class Visibility(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VISIBILITY_UNSPECIFIED: _ClassVar[Visibility]
    VISIBILITY_EVERYONE: _ClassVar[Visibility]
    VISIBILITY_AUDIENCE: _ClassVar[Visibility]
    VISIBILITY_NOBODY: _ClassVar[Visibility]

class UnregisterOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    UNREGISTER_OUTCOME_UNSPECIFIED: _ClassVar[UnregisterOutcome]
    UNREGISTER_OUTCOME_REMOVED: _ClassVar[UnregisterOutcome]
    UNREGISTER_OUTCOME_LINGERING: _ClassVar[UnregisterOutcome]
    UNREGISTER_OUTCOME_STALE_GENERATION: _ClassVar[UnregisterOutcome]
    UNREGISTER_OUTCOME_NOT_FOUND: _ClassVar[UnregisterOutcome]

class RoomWatchMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROOM_WATCH_UNSPECIFIED: _ClassVar[RoomWatchMode]
    ROOM_WATCH_MEMBERS: _ClassVar[RoomWatchMode]
    ROOM_WATCH_COUNT: _ClassVar[RoomWatchMode]

class RoomChangeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROOM_CHANGE_UNSPECIFIED: _ClassVar[RoomChangeKind]
    ROOM_CHANGE_JOINED: _ClassVar[RoomChangeKind]
    ROOM_CHANGE_LEFT: _ClassVar[RoomChangeKind]
    ROOM_CHANGE_UPDATED: _ClassVar[RoomChangeKind]

class RoomAccess(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROOM_ACCESS_UNSPECIFIED: _ClassVar[RoomAccess]
    ROOM_ACCESS_MEMBERS: _ClassVar[RoomAccess]
    ROOM_ACCESS_PUBLIC: _ClassVar[RoomAccess]

class ChangesFrom(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHANGES_FROM_UNSPECIFIED: _ClassVar[ChangesFrom]
    CHANGES_FROM_NOW: _ClassVar[ChangesFrom]
    CHANGES_FROM_OLDEST: _ClassVar[ChangesFrom]
    CHANGES_FROM_CURSOR: _ClassVar[ChangesFrom]

class ChangeKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CHANGE_KIND_UNSPECIFIED: _ClassVar[ChangeKind]
    CHANGE_KIND_FLIP: _ClassVar[ChangeKind]
    CHANGE_KIND_STATUS: _ClassVar[ChangeKind]
    CHANGE_KIND_ROOM_OCCUPANCY: _ClassVar[ChangeKind]
    CHANGE_KIND_AVAILABILITY: _ClassVar[ChangeKind]
ATTENTION_UNSPECIFIED: Attention
ATTENTION_ACTIVE: Attention
ATTENTION_IDLE: Attention
ATTENTION_BACKGROUND: Attention
DEVICE_UNSPECIFIED: DeviceKind
DEVICE_DESKTOP: DeviceKind
DEVICE_MOBILE: DeviceKind
DEVICE_WEB: DeviceKind
DEVICE_OTHER: DeviceKind
URGENCY_NORMAL: Urgency
URGENCY_URGENT: Urgency
NOTIFY_REASON_UNSPECIFIED: NotifyReason
NOTIFY_REASON_ROOM_OPEN: NotifyReason
NOTIFY_REASON_ATTENDED_ELSEWHERE: NotifyReason
NOTIFY_REASON_NO_ATTENDED_SESSION: NotifyReason
NOTIFY_REASON_UNKNOWN_FAIL_OPEN: NotifyReason
NOTIFY_REASON_OFFLINE: NotifyReason
NOTIFY_REASON_URGENT: NotifyReason
STATE_UNSPECIFIED: State
STATE_OFFLINE: State
STATE_ONLINE: State
AVAILABILITY_UNSPECIFIED: Availability
AVAILABILITY_AVAILABLE: Availability
AVAILABILITY_AWAY: Availability
AVAILABILITY_DO_NOT_DISTURB: Availability
AVAILABILITY_ACTIVE: Availability
VISIBILITY_UNSPECIFIED: Visibility
VISIBILITY_EVERYONE: Visibility
VISIBILITY_AUDIENCE: Visibility
VISIBILITY_NOBODY: Visibility
UNREGISTER_OUTCOME_UNSPECIFIED: UnregisterOutcome
UNREGISTER_OUTCOME_REMOVED: UnregisterOutcome
UNREGISTER_OUTCOME_LINGERING: UnregisterOutcome
UNREGISTER_OUTCOME_STALE_GENERATION: UnregisterOutcome
UNREGISTER_OUTCOME_NOT_FOUND: UnregisterOutcome
ROOM_WATCH_UNSPECIFIED: RoomWatchMode
ROOM_WATCH_MEMBERS: RoomWatchMode
ROOM_WATCH_COUNT: RoomWatchMode
ROOM_CHANGE_UNSPECIFIED: RoomChangeKind
ROOM_CHANGE_JOINED: RoomChangeKind
ROOM_CHANGE_LEFT: RoomChangeKind
ROOM_CHANGE_UPDATED: RoomChangeKind
ROOM_ACCESS_UNSPECIFIED: RoomAccess
ROOM_ACCESS_MEMBERS: RoomAccess
ROOM_ACCESS_PUBLIC: RoomAccess
CHANGES_FROM_UNSPECIFIED: ChangesFrom
CHANGES_FROM_NOW: ChangesFrom
CHANGES_FROM_OLDEST: ChangesFrom
CHANGES_FROM_CURSOR: ChangesFrom
CHANGE_KIND_UNSPECIFIED: ChangeKind
CHANGE_KIND_FLIP: ChangeKind
CHANGE_KIND_STATUS: ChangeKind
CHANGE_KIND_ROOM_OCCUPANCY: ChangeKind
CHANGE_KIND_AVAILABILITY: ChangeKind

class NotifyTargetsRequest(_message.Message):
    __slots__ = ("user_ids", "room_id", "urgency", "handoff_ms")
    USER_IDS_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    URGENCY_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    user_ids: _containers.RepeatedScalarFieldContainer[str]
    room_id: str
    urgency: Urgency
    handoff_ms: int
    def __init__(self, user_ids: _Optional[_Iterable[str]] = ..., room_id: _Optional[str] = ..., urgency: _Optional[_Union[Urgency, str]] = ..., handoff_ms: _Optional[int] = ...) -> None: ...

class NotifyTarget(_message.Message):
    __slots__ = ("user_id", "in_app_session_ids", "push_now", "push_after_ms", "reason")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    IN_APP_SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    PUSH_NOW_FIELD_NUMBER: _ClassVar[int]
    PUSH_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    in_app_session_ids: _containers.RepeatedScalarFieldContainer[str]
    push_now: bool
    push_after_ms: int
    reason: NotifyReason
    def __init__(self, user_id: _Optional[str] = ..., in_app_session_ids: _Optional[_Iterable[str]] = ..., push_now: _Optional[bool] = ..., push_after_ms: _Optional[int] = ..., reason: _Optional[_Union[NotifyReason, str]] = ...) -> None: ...

class NotifyTargetsResponse(_message.Message):
    __slots__ = ("targets",)
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedCompositeFieldContainer[NotifyTarget]
    def __init__(self, targets: _Optional[_Iterable[_Union[NotifyTarget, _Mapping]]] = ...) -> None: ...

class Status(_message.Message):
    __slots__ = ("availability", "text", "expires_at_ms")
    AVAILABILITY_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    availability: Availability
    text: str
    expires_at_ms: int
    def __init__(self, availability: _Optional[_Union[Availability, str]] = ..., text: _Optional[str] = ..., expires_at_ms: _Optional[int] = ...) -> None: ...

class UserPresence(_message.Message):
    __slots__ = ("user_id", "state", "version", "last_active_at_ms", "status", "last_seen_ms", "availability")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVE_AT_MS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_MS_FIELD_NUMBER: _ClassVar[int]
    AVAILABILITY_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    state: State
    version: int
    last_active_at_ms: int
    status: Status
    last_seen_ms: int
    availability: Availability
    def __init__(self, user_id: _Optional[str] = ..., state: _Optional[_Union[State, str]] = ..., version: _Optional[int] = ..., last_active_at_ms: _Optional[int] = ..., status: _Optional[_Union[Status, _Mapping]] = ..., last_seen_ms: _Optional[int] = ..., availability: _Optional[_Union[Availability, str]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("user_id", "session_id", "gateway_id", "ttl_ms", "metadata", "device_kind", "attention", "focused_room_id")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    FOCUSED_ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    session_id: str
    gateway_id: str
    ttl_ms: int
    metadata: _containers.ScalarMap[str, str]
    device_kind: DeviceKind
    attention: Attention
    focused_room_id: str
    def __init__(self, user_id: _Optional[str] = ..., session_id: _Optional[str] = ..., gateway_id: _Optional[str] = ..., ttl_ms: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., device_kind: _Optional[_Union[DeviceKind, str]] = ..., attention: _Optional[_Union[Attention, str]] = ..., focused_room_id: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("generation", "changed", "presence", "expires_at_ms")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    generation: int
    changed: bool
    presence: UserPresence
    expires_at_ms: int
    def __init__(self, generation: _Optional[int] = ..., changed: _Optional[bool] = ..., presence: _Optional[_Union[UserPresence, _Mapping]] = ..., expires_at_ms: _Optional[int] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("user_id", "session_id", "generation", "ttl_ms", "attention", "focused_room_id")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    FOCUSED_ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    session_id: str
    generation: int
    ttl_ms: int
    attention: Attention
    focused_room_id: str
    def __init__(self, user_id: _Optional[str] = ..., session_id: _Optional[str] = ..., generation: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., attention: _Optional[_Union[Attention, str]] = ..., focused_room_id: _Optional[str] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("expires_at_ms", "throttled")
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    THROTTLED_FIELD_NUMBER: _ClassVar[int]
    expires_at_ms: int
    throttled: bool
    def __init__(self, expires_at_ms: _Optional[int] = ..., throttled: _Optional[bool] = ...) -> None: ...

class UnregisterRequest(_message.Message):
    __slots__ = ("user_id", "session_id", "generation", "linger_ms")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LINGER_MS_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    session_id: str
    generation: int
    linger_ms: int
    def __init__(self, user_id: _Optional[str] = ..., session_id: _Optional[str] = ..., generation: _Optional[int] = ..., linger_ms: _Optional[int] = ...) -> None: ...

class UnregisterResponse(_message.Message):
    __slots__ = ("removed", "changed", "presence", "outcome")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    changed: bool
    presence: UserPresence
    outcome: UnregisterOutcome
    def __init__(self, removed: _Optional[bool] = ..., changed: _Optional[bool] = ..., presence: _Optional[_Union[UserPresence, _Mapping]] = ..., outcome: _Optional[_Union[UnregisterOutcome, str]] = ...) -> None: ...

class RevokeRequest(_message.Message):
    __slots__ = ("user_id", "session_id")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    session_id: str
    def __init__(self, user_id: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class RevokeResponse(_message.Message):
    __slots__ = ("revoked", "changed", "presence")
    REVOKED_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    revoked: int
    changed: bool
    presence: UserPresence
    def __init__(self, revoked: _Optional[int] = ..., changed: _Optional[bool] = ..., presence: _Optional[_Union[UserPresence, _Mapping]] = ...) -> None: ...

class LeaseItem(_message.Message):
    __slots__ = ("register", "renew", "unregister", "join", "leave", "signal")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    RENEW_FIELD_NUMBER: _ClassVar[int]
    UNREGISTER_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    register: RegisterRequest
    renew: RenewRequest
    unregister: UnregisterRequest
    join: JoinRequest
    leave: LeaveRequest
    signal: SignalRequest
    def __init__(self, register: _Optional[_Union[RegisterRequest, _Mapping]] = ..., renew: _Optional[_Union[RenewRequest, _Mapping]] = ..., unregister: _Optional[_Union[UnregisterRequest, _Mapping]] = ..., join: _Optional[_Union[JoinRequest, _Mapping]] = ..., leave: _Optional[_Union[LeaveRequest, _Mapping]] = ..., signal: _Optional[_Union[SignalRequest, _Mapping]] = ...) -> None: ...

class LeaseBatch(_message.Message):
    __slots__ = ("batch_id", "items")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    items: _containers.RepeatedCompositeFieldContainer[LeaseItem]
    def __init__(self, batch_id: _Optional[int] = ..., items: _Optional[_Iterable[_Union[LeaseItem, _Mapping]]] = ...) -> None: ...

class LeaseResult(_message.Message):
    __slots__ = ("code", "message", "register", "renew", "unregister", "join", "leave", "signal", "not_owner")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    RENEW_FIELD_NUMBER: _ClassVar[int]
    UNREGISTER_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    LEAVE_FIELD_NUMBER: _ClassVar[int]
    SIGNAL_FIELD_NUMBER: _ClassVar[int]
    NOT_OWNER_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    register: RegisterResponse
    renew: RenewResponse
    unregister: UnregisterResponse
    join: JoinResponse
    leave: LeaveResponse
    signal: SignalResponse
    not_owner: NotOwner
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., register: _Optional[_Union[RegisterResponse, _Mapping]] = ..., renew: _Optional[_Union[RenewResponse, _Mapping]] = ..., unregister: _Optional[_Union[UnregisterResponse, _Mapping]] = ..., join: _Optional[_Union[JoinResponse, _Mapping]] = ..., leave: _Optional[_Union[LeaveResponse, _Mapping]] = ..., signal: _Optional[_Union[SignalResponse, _Mapping]] = ..., not_owner: _Optional[_Union[NotOwner, _Mapping]] = ...) -> None: ...

class LeaseResults(_message.Message):
    __slots__ = ("batch_id", "results")
    BATCH_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    batch_id: int
    results: _containers.RepeatedCompositeFieldContainer[LeaseResult]
    def __init__(self, batch_id: _Optional[int] = ..., results: _Optional[_Iterable[_Union[LeaseResult, _Mapping]]] = ...) -> None: ...

class TouchRequest(_message.Message):
    __slots__ = ("user_id",)
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    def __init__(self, user_id: _Optional[str] = ...) -> None: ...

class TouchResponse(_message.Message):
    __slots__ = ("last_active_at_ms",)
    LAST_ACTIVE_AT_MS_FIELD_NUMBER: _ClassVar[int]
    last_active_at_ms: int
    def __init__(self, last_active_at_ms: _Optional[int] = ...) -> None: ...

class PutSettingRequest(_message.Message):
    __slots__ = ("user_id", "name", "value")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    name: str
    value: bytes
    def __init__(self, user_id: _Optional[str] = ..., name: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...

class PutSettingResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetSettingsRequest(_message.Message):
    __slots__ = ("user_id",)
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    def __init__(self, user_id: _Optional[str] = ...) -> None: ...

class GetSettingsResponse(_message.Message):
    __slots__ = ("settings",)
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    settings: _containers.ScalarMap[str, bytes]
    def __init__(self, settings: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class SetStatusRequest(_message.Message):
    __slots__ = ("user_id", "status")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    status: Status
    def __init__(self, user_id: _Optional[str] = ..., status: _Optional[_Union[Status, _Mapping]] = ...) -> None: ...

class SetStatusResponse(_message.Message):
    __slots__ = ("presence",)
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    presence: UserPresence
    def __init__(self, presence: _Optional[_Union[UserPresence, _Mapping]] = ...) -> None: ...

class SetVisibilityRequest(_message.Message):
    __slots__ = ("user_id", "visibility", "share_activity")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    VISIBILITY_FIELD_NUMBER: _ClassVar[int]
    SHARE_ACTIVITY_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    visibility: Visibility
    share_activity: bool
    def __init__(self, user_id: _Optional[str] = ..., visibility: _Optional[_Union[Visibility, str]] = ..., share_activity: _Optional[bool] = ...) -> None: ...

class SetVisibilityResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AudienceRequest(_message.Message):
    __slots__ = ("user_id", "viewer_ids")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    VIEWER_IDS_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    viewer_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, user_id: _Optional[str] = ..., viewer_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AudienceResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GroupRequest(_message.Message):
    __slots__ = ("group_id", "user_ids")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    USER_IDS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    user_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, group_id: _Optional[str] = ..., user_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class GroupResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ("user_ids", "viewer_id")
    USER_IDS_FIELD_NUMBER: _ClassVar[int]
    VIEWER_ID_FIELD_NUMBER: _ClassVar[int]
    user_ids: _containers.RepeatedScalarFieldContainer[str]
    viewer_id: str
    def __init__(self, user_ids: _Optional[_Iterable[str]] = ..., viewer_id: _Optional[str] = ...) -> None: ...

class SnapshotResponse(_message.Message):
    __slots__ = ("users",)
    USERS_FIELD_NUMBER: _ClassVar[int]
    users: _containers.RepeatedCompositeFieldContainer[UserPresence]
    def __init__(self, users: _Optional[_Iterable[_Union[UserPresence, _Mapping]]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("user_ids", "viewer_id", "batch_window_ms", "known_versions")
    class KnownVersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    USER_IDS_FIELD_NUMBER: _ClassVar[int]
    VIEWER_ID_FIELD_NUMBER: _ClassVar[int]
    BATCH_WINDOW_MS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    user_ids: _containers.RepeatedScalarFieldContainer[str]
    viewer_id: str
    batch_window_ms: int
    known_versions: _containers.ScalarMap[str, int]
    def __init__(self, user_ids: _Optional[_Iterable[str]] = ..., viewer_id: _Optional[str] = ..., batch_window_ms: _Optional[int] = ..., known_versions: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("users", "watch_id", "partial")
    USERS_FIELD_NUMBER: _ClassVar[int]
    WATCH_ID_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    users: _containers.RepeatedCompositeFieldContainer[UserPresence]
    watch_id: str
    partial: bool
    def __init__(self, users: _Optional[_Iterable[_Union[UserPresence, _Mapping]]] = ..., watch_id: _Optional[str] = ..., partial: _Optional[bool] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("snapshot", "update", "updates", "added")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    UPDATE_FIELD_NUMBER: _ClassVar[int]
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    ADDED_FIELD_NUMBER: _ClassVar[int]
    snapshot: Snapshot
    update: UserPresence
    updates: UpdateBatch
    added: Snapshot
    def __init__(self, snapshot: _Optional[_Union[Snapshot, _Mapping]] = ..., update: _Optional[_Union[UserPresence, _Mapping]] = ..., updates: _Optional[_Union[UpdateBatch, _Mapping]] = ..., added: _Optional[_Union[Snapshot, _Mapping]] = ...) -> None: ...

class UpdateBatch(_message.Message):
    __slots__ = ("users",)
    USERS_FIELD_NUMBER: _ClassVar[int]
    users: _containers.RepeatedCompositeFieldContainer[UserPresence]
    def __init__(self, users: _Optional[_Iterable[_Union[UserPresence, _Mapping]]] = ...) -> None: ...

class UpdateWatchRequest(_message.Message):
    __slots__ = ("watch_id", "add_user_ids", "remove_user_ids", "viewer_id")
    WATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_USER_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_USER_IDS_FIELD_NUMBER: _ClassVar[int]
    VIEWER_ID_FIELD_NUMBER: _ClassVar[int]
    watch_id: str
    add_user_ids: _containers.RepeatedScalarFieldContainer[str]
    remove_user_ids: _containers.RepeatedScalarFieldContainer[str]
    viewer_id: str
    def __init__(self, watch_id: _Optional[str] = ..., add_user_ids: _Optional[_Iterable[str]] = ..., remove_user_ids: _Optional[_Iterable[str]] = ..., viewer_id: _Optional[str] = ...) -> None: ...

class UpdateWatchResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("user_id", "session_id", "generation", "room_id", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    session_id: str
    generation: int
    room_id: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, user_id: _Optional[str] = ..., session_id: _Optional[str] = ..., generation: _Optional[int] = ..., room_id: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class JoinResponse(_message.Message):
    __slots__ = ("changed", "room_version")
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    ROOM_VERSION_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    room_version: int
    def __init__(self, changed: _Optional[bool] = ..., room_version: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("user_id", "session_id", "generation", "room_id")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    session_id: str
    generation: int
    room_id: str
    def __init__(self, user_id: _Optional[str] = ..., session_id: _Optional[str] = ..., generation: _Optional[int] = ..., room_id: _Optional[str] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("removed", "changed", "room_version")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    ROOM_VERSION_FIELD_NUMBER: _ClassVar[int]
    removed: bool
    changed: bool
    room_version: int
    def __init__(self, removed: _Optional[bool] = ..., changed: _Optional[bool] = ..., room_version: _Optional[int] = ...) -> None: ...

class SignalRequest(_message.Message):
    __slots__ = ("user_id", "session_id", "generation", "room_id", "kind", "ttl_ms")
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    session_id: str
    generation: int
    room_id: str
    kind: str
    ttl_ms: int
    def __init__(self, user_id: _Optional[str] = ..., session_id: _Optional[str] = ..., generation: _Optional[int] = ..., room_id: _Optional[str] = ..., kind: _Optional[str] = ..., ttl_ms: _Optional[int] = ...) -> None: ...

class SignalResponse(_message.Message):
    __slots__ = ("changed", "room_version")
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    ROOM_VERSION_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    room_version: int
    def __init__(self, changed: _Optional[bool] = ..., room_version: _Optional[int] = ...) -> None: ...

class RoomSnapshotRequest(_message.Message):
    __slots__ = ("room_id", "viewer_id")
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    VIEWER_ID_FIELD_NUMBER: _ClassVar[int]
    room_id: str
    viewer_id: str
    def __init__(self, room_id: _Optional[str] = ..., viewer_id: _Optional[str] = ...) -> None: ...

class RoomMember(_message.Message):
    __slots__ = ("user_id", "metadata", "sessions")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    metadata: _containers.ScalarMap[str, str]
    sessions: int
    def __init__(self, user_id: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., sessions: _Optional[int] = ...) -> None: ...

class RoomSnapshot(_message.Message):
    __slots__ = ("room_id", "version", "users", "sessions", "members", "members_omitted", "signals")
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    room_id: str
    version: int
    users: int
    sessions: int
    members: _containers.RepeatedCompositeFieldContainer[RoomMember]
    members_omitted: bool
    signals: _containers.RepeatedCompositeFieldContainer[SignalSet]
    def __init__(self, room_id: _Optional[str] = ..., version: _Optional[int] = ..., users: _Optional[int] = ..., sessions: _Optional[int] = ..., members: _Optional[_Iterable[_Union[RoomMember, _Mapping]]] = ..., members_omitted: _Optional[bool] = ..., signals: _Optional[_Iterable[_Union[SignalSet, _Mapping]]] = ...) -> None: ...

class WatchRoomRequest(_message.Message):
    __slots__ = ("room_id", "viewer_id", "mode", "count_interval_ms")
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    VIEWER_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    COUNT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    room_id: str
    viewer_id: str
    mode: RoomWatchMode
    count_interval_ms: int
    def __init__(self, room_id: _Optional[str] = ..., viewer_id: _Optional[str] = ..., mode: _Optional[_Union[RoomWatchMode, str]] = ..., count_interval_ms: _Optional[int] = ...) -> None: ...

class RoomMemberChange(_message.Message):
    __slots__ = ("room_id", "version", "kind", "member")
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    room_id: str
    version: int
    kind: RoomChangeKind
    member: RoomMember
    def __init__(self, room_id: _Optional[str] = ..., version: _Optional[int] = ..., kind: _Optional[_Union[RoomChangeKind, str]] = ..., member: _Optional[_Union[RoomMember, _Mapping]] = ...) -> None: ...

class RoomCount(_message.Message):
    __slots__ = ("room_id", "version", "users", "sessions")
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    room_id: str
    version: int
    users: int
    sessions: int
    def __init__(self, room_id: _Optional[str] = ..., version: _Optional[int] = ..., users: _Optional[int] = ..., sessions: _Optional[int] = ...) -> None: ...

class RoomCountsRequest(_message.Message):
    __slots__ = ("room_ids", "viewer_id")
    ROOM_IDS_FIELD_NUMBER: _ClassVar[int]
    VIEWER_ID_FIELD_NUMBER: _ClassVar[int]
    room_ids: _containers.RepeatedScalarFieldContainer[str]
    viewer_id: str
    def __init__(self, room_ids: _Optional[_Iterable[str]] = ..., viewer_id: _Optional[str] = ...) -> None: ...

class WatchRoomCountsRequest(_message.Message):
    __slots__ = ("room_ids", "viewer_id", "count_interval_ms")
    ROOM_IDS_FIELD_NUMBER: _ClassVar[int]
    VIEWER_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    room_ids: _containers.RepeatedScalarFieldContainer[str]
    viewer_id: str
    count_interval_ms: int
    def __init__(self, room_ids: _Optional[_Iterable[str]] = ..., viewer_id: _Optional[str] = ..., count_interval_ms: _Optional[int] = ...) -> None: ...

class RoomCounts(_message.Message):
    __slots__ = ("counts", "watch_id")
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    WATCH_ID_FIELD_NUMBER: _ClassVar[int]
    counts: _containers.RepeatedCompositeFieldContainer[RoomCount]
    watch_id: str
    def __init__(self, counts: _Optional[_Iterable[_Union[RoomCount, _Mapping]]] = ..., watch_id: _Optional[str] = ...) -> None: ...

class UpdateWatchRoomCountsRequest(_message.Message):
    __slots__ = ("watch_id", "add_room_ids", "remove_room_ids", "viewer_id")
    WATCH_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_ROOM_IDS_FIELD_NUMBER: _ClassVar[int]
    REMOVE_ROOM_IDS_FIELD_NUMBER: _ClassVar[int]
    VIEWER_ID_FIELD_NUMBER: _ClassVar[int]
    watch_id: str
    add_room_ids: _containers.RepeatedScalarFieldContainer[str]
    remove_room_ids: _containers.RepeatedScalarFieldContainer[str]
    viewer_id: str
    def __init__(self, watch_id: _Optional[str] = ..., add_room_ids: _Optional[_Iterable[str]] = ..., remove_room_ids: _Optional[_Iterable[str]] = ..., viewer_id: _Optional[str] = ...) -> None: ...

class UpdateWatchRoomCountsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SignalSet(_message.Message):
    __slots__ = ("room_id", "version", "kind", "user_ids", "count")
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    USER_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    room_id: str
    version: int
    kind: str
    user_ids: _containers.RepeatedScalarFieldContainer[str]
    count: int
    def __init__(self, room_id: _Optional[str] = ..., version: _Optional[int] = ..., kind: _Optional[str] = ..., user_ids: _Optional[_Iterable[str]] = ..., count: _Optional[int] = ...) -> None: ...

class RoomEvent(_message.Message):
    __slots__ = ("snapshot", "change", "count", "signals")
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    CHANGE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SIGNALS_FIELD_NUMBER: _ClassVar[int]
    snapshot: RoomSnapshot
    change: RoomMemberChange
    count: RoomCount
    signals: SignalSet
    def __init__(self, snapshot: _Optional[_Union[RoomSnapshot, _Mapping]] = ..., change: _Optional[_Union[RoomMemberChange, _Mapping]] = ..., count: _Optional[_Union[RoomCount, _Mapping]] = ..., signals: _Optional[_Union[SignalSet, _Mapping]] = ...) -> None: ...

class SetRoomAccessRequest(_message.Message):
    __slots__ = ("room_id", "access")
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    room_id: str
    access: RoomAccess
    def __init__(self, room_id: _Optional[str] = ..., access: _Optional[_Union[RoomAccess, str]] = ...) -> None: ...

class SetRoomAccessResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("user_id",)
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    def __init__(self, user_id: _Optional[str] = ...) -> None: ...

class SessionInfo(_message.Message):
    __slots__ = ("gateway_id", "session_id", "generation", "expires_at_ms", "metadata", "rooms", "last_renewed_at_ms", "lingering")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_MS_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    LAST_RENEWED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    LINGERING_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    session_id: str
    generation: int
    expires_at_ms: int
    metadata: _containers.ScalarMap[str, str]
    rooms: _containers.RepeatedScalarFieldContainer[str]
    last_renewed_at_ms: int
    lingering: bool
    def __init__(self, gateway_id: _Optional[str] = ..., session_id: _Optional[str] = ..., generation: _Optional[int] = ..., expires_at_ms: _Optional[int] = ..., metadata: _Optional[_Mapping[str, str]] = ..., rooms: _Optional[_Iterable[str]] = ..., last_renewed_at_ms: _Optional[int] = ..., lingering: _Optional[bool] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions", "now_ms")
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    NOW_MS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    now_ms: int
    def __init__(self, sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., now_ms: _Optional[int] = ...) -> None: ...

class BackupRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BackupChunk(_message.Message):
    __slots__ = ("data", "last", "users", "sessions", "durable_rows")
    DATA_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    DURABLE_ROWS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    last: bool
    users: int
    sessions: int
    durable_rows: int
    def __init__(self, data: _Optional[bytes] = ..., last: _Optional[bool] = ..., users: _Optional[int] = ..., sessions: _Optional[int] = ..., durable_rows: _Optional[int] = ...) -> None: ...

class ExportUserRequest(_message.Message):
    __slots__ = ("user_id",)
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    def __init__(self, user_id: _Optional[str] = ...) -> None: ...

class ExportedRoomMembership(_message.Message):
    __slots__ = ("room_id", "session_id", "metadata")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    room_id: str
    session_id: str
    metadata: _containers.ScalarMap[str, str]
    def __init__(self, room_id: _Optional[str] = ..., session_id: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ...) -> None: ...

class ExportUserResponse(_message.Message):
    __slots__ = ("user_id", "exported_at_ms", "held", "presence", "sessions", "rooms", "status", "visibility", "visibility_is_default", "audience", "in_audience_of", "groups", "last_active_at_ms", "settings")
    class SettingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_AT_MS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VISIBILITY_FIELD_NUMBER: _ClassVar[int]
    VISIBILITY_IS_DEFAULT_FIELD_NUMBER: _ClassVar[int]
    AUDIENCE_FIELD_NUMBER: _ClassVar[int]
    IN_AUDIENCE_OF_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVE_AT_MS_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    exported_at_ms: int
    held: bool
    presence: UserPresence
    sessions: _containers.RepeatedCompositeFieldContainer[SessionInfo]
    rooms: _containers.RepeatedCompositeFieldContainer[ExportedRoomMembership]
    status: Status
    visibility: Visibility
    visibility_is_default: bool
    audience: _containers.RepeatedScalarFieldContainer[str]
    in_audience_of: _containers.RepeatedScalarFieldContainer[str]
    groups: _containers.RepeatedScalarFieldContainer[str]
    last_active_at_ms: int
    settings: _containers.ScalarMap[str, bytes]
    def __init__(self, user_id: _Optional[str] = ..., exported_at_ms: _Optional[int] = ..., held: _Optional[bool] = ..., presence: _Optional[_Union[UserPresence, _Mapping]] = ..., sessions: _Optional[_Iterable[_Union[SessionInfo, _Mapping]]] = ..., rooms: _Optional[_Iterable[_Union[ExportedRoomMembership, _Mapping]]] = ..., status: _Optional[_Union[Status, _Mapping]] = ..., visibility: _Optional[_Union[Visibility, str]] = ..., visibility_is_default: _Optional[bool] = ..., audience: _Optional[_Iterable[str]] = ..., in_audience_of: _Optional[_Iterable[str]] = ..., groups: _Optional[_Iterable[str]] = ..., last_active_at_ms: _Optional[int] = ..., settings: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class EraseUserRequest(_message.Message):
    __slots__ = ("user_id",)
    USER_ID_FIELD_NUMBER: _ClassVar[int]
    user_id: str
    def __init__(self, user_id: _Optional[str] = ...) -> None: ...

class EraseUserResponse(_message.Message):
    __slots__ = ("sessions_revoked", "rooms_left", "went_offline", "status_removed", "visibility_removed", "audience_removed", "removed_from_audiences", "groups_left", "settings_removed", "activity_removed", "presence_forgotten")
    SESSIONS_REVOKED_FIELD_NUMBER: _ClassVar[int]
    ROOMS_LEFT_FIELD_NUMBER: _ClassVar[int]
    WENT_OFFLINE_FIELD_NUMBER: _ClassVar[int]
    STATUS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    VISIBILITY_REMOVED_FIELD_NUMBER: _ClassVar[int]
    AUDIENCE_REMOVED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FROM_AUDIENCES_FIELD_NUMBER: _ClassVar[int]
    GROUPS_LEFT_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ACTIVITY_REMOVED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_FORGOTTEN_FIELD_NUMBER: _ClassVar[int]
    sessions_revoked: int
    rooms_left: int
    went_offline: bool
    status_removed: bool
    visibility_removed: bool
    audience_removed: int
    removed_from_audiences: int
    groups_left: int
    settings_removed: int
    activity_removed: bool
    presence_forgotten: bool
    def __init__(self, sessions_revoked: _Optional[int] = ..., rooms_left: _Optional[int] = ..., went_offline: _Optional[bool] = ..., status_removed: _Optional[bool] = ..., visibility_removed: _Optional[bool] = ..., audience_removed: _Optional[int] = ..., removed_from_audiences: _Optional[int] = ..., groups_left: _Optional[int] = ..., settings_removed: _Optional[int] = ..., activity_removed: _Optional[bool] = ..., presence_forgotten: _Optional[bool] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Histogram(_message.Message):
    __slots__ = ("bounds_seconds", "counts", "count", "sum_seconds")
    BOUNDS_SECONDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    SUM_SECONDS_FIELD_NUMBER: _ClassVar[int]
    bounds_seconds: _containers.RepeatedScalarFieldContainer[float]
    counts: _containers.RepeatedScalarFieldContainer[int]
    count: int
    sum_seconds: float
    def __init__(self, bounds_seconds: _Optional[_Iterable[float]] = ..., counts: _Optional[_Iterable[int]] = ..., count: _Optional[int] = ..., sum_seconds: _Optional[float] = ...) -> None: ...

class TtlSettings(_message.Message):
    __slots__ = ("min_ttl_ms", "max_ttl_ms", "default_ttl_ms", "suggested_heartbeat_ms", "min_renew_interval_ms", "offline_grace_ms")
    MIN_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    SUGGESTED_HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    MIN_RENEW_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_GRACE_MS_FIELD_NUMBER: _ClassVar[int]
    min_ttl_ms: int
    max_ttl_ms: int
    default_ttl_ms: int
    suggested_heartbeat_ms: int
    min_renew_interval_ms: int
    offline_grace_ms: int
    def __init__(self, min_ttl_ms: _Optional[int] = ..., max_ttl_ms: _Optional[int] = ..., default_ttl_ms: _Optional[int] = ..., suggested_heartbeat_ms: _Optional[int] = ..., min_renew_interval_ms: _Optional[int] = ..., offline_grace_ms: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("version", "uptime_ms", "now_ms", "sessions", "online_users", "users", "rooms", "room_memberships", "viewers", "room_watchers", "renewals_total", "renewals_shed_total", "registers_total", "unregisters_total", "expiries_total", "expiry_lag", "ttl", "room_count_streams", "relay_links", "relayed_users", "relay_sessions")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    NOW_MS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ONLINE_USERS_FIELD_NUMBER: _ClassVar[int]
    USERS_FIELD_NUMBER: _ClassVar[int]
    ROOMS_FIELD_NUMBER: _ClassVar[int]
    ROOM_MEMBERSHIPS_FIELD_NUMBER: _ClassVar[int]
    VIEWERS_FIELD_NUMBER: _ClassVar[int]
    ROOM_WATCHERS_FIELD_NUMBER: _ClassVar[int]
    RENEWALS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    RENEWALS_SHED_TOTAL_FIELD_NUMBER: _ClassVar[int]
    REGISTERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    UNREGISTERS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPIRIES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_LAG_FIELD_NUMBER: _ClassVar[int]
    TTL_FIELD_NUMBER: _ClassVar[int]
    ROOM_COUNT_STREAMS_FIELD_NUMBER: _ClassVar[int]
    RELAY_LINKS_FIELD_NUMBER: _ClassVar[int]
    RELAYED_USERS_FIELD_NUMBER: _ClassVar[int]
    RELAY_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_ms: int
    now_ms: int
    sessions: int
    online_users: int
    users: int
    rooms: int
    room_memberships: int
    viewers: int
    room_watchers: int
    renewals_total: int
    renewals_shed_total: int
    registers_total: int
    unregisters_total: int
    expiries_total: int
    expiry_lag: Histogram
    ttl: TtlSettings
    room_count_streams: int
    relay_links: int
    relayed_users: int
    relay_sessions: int
    def __init__(self, version: _Optional[str] = ..., uptime_ms: _Optional[int] = ..., now_ms: _Optional[int] = ..., sessions: _Optional[int] = ..., online_users: _Optional[int] = ..., users: _Optional[int] = ..., rooms: _Optional[int] = ..., room_memberships: _Optional[int] = ..., viewers: _Optional[int] = ..., room_watchers: _Optional[int] = ..., renewals_total: _Optional[int] = ..., renewals_shed_total: _Optional[int] = ..., registers_total: _Optional[int] = ..., unregisters_total: _Optional[int] = ..., expiries_total: _Optional[int] = ..., expiry_lag: _Optional[_Union[Histogram, _Mapping]] = ..., ttl: _Optional[_Union[TtlSettings, _Mapping]] = ..., room_count_streams: _Optional[int] = ..., relay_links: _Optional[int] = ..., relayed_users: _Optional[int] = ..., relay_sessions: _Optional[int] = ...) -> None: ...

class ChangesRequest(_message.Message):
    __slots__ = ("cursor", "kinds", "id_prefix", "slots")
    FROM_FIELD_NUMBER: _ClassVar[int]
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    ID_PREFIX_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    cursor: bytes
    kinds: _containers.RepeatedScalarFieldContainer[ChangeKind]
    id_prefix: str
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, cursor: _Optional[bytes] = ..., kinds: _Optional[_Iterable[_Union[ChangeKind, str]]] = ..., id_prefix: _Optional[str] = ..., slots: _Optional[_Iterable[int]] = ..., **kwargs) -> None: ...

class RoomOccupancy(_message.Message):
    __slots__ = ("room_id", "occupied", "version")
    ROOM_ID_FIELD_NUMBER: _ClassVar[int]
    OCCUPIED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    room_id: str
    occupied: bool
    version: int
    def __init__(self, room_id: _Optional[str] = ..., occupied: _Optional[bool] = ..., version: _Optional[int] = ...) -> None: ...

class Gap(_message.Message):
    __slots__ = ("after_cursor", "reason", "lost")
    AFTER_CURSOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    after_cursor: bytes
    reason: str
    lost: int
    def __init__(self, after_cursor: _Optional[bytes] = ..., reason: _Optional[str] = ..., lost: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChangeEvent(_message.Message):
    __slots__ = ("cursor", "flip", "status", "availability", "room_occupancy", "gap", "progress", "at_ms", "slot")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    FLIP_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    AVAILABILITY_FIELD_NUMBER: _ClassVar[int]
    ROOM_OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    GAP_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    AT_MS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    cursor: bytes
    flip: UserPresence
    status: UserPresence
    availability: UserPresence
    room_occupancy: RoomOccupancy
    gap: Gap
    progress: Progress
    at_ms: int
    slot: int
    def __init__(self, cursor: _Optional[bytes] = ..., flip: _Optional[_Union[UserPresence, _Mapping]] = ..., status: _Optional[_Union[UserPresence, _Mapping]] = ..., availability: _Optional[_Union[UserPresence, _Mapping]] = ..., room_occupancy: _Optional[_Union[RoomOccupancy, _Mapping]] = ..., gap: _Optional[_Union[Gap, _Mapping]] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., at_ms: _Optional[int] = ..., slot: _Optional[int] = ...) -> None: ...

class ChangesOutOfRange(_message.Message):
    __slots__ = ("oldest_cursor",)
    OLDEST_CURSOR_FIELD_NUMBER: _ClassVar[int]
    oldest_cursor: bytes
    def __init__(self, oldest_cursor: _Optional[bytes] = ...) -> None: ...

class NotOwner(_message.Message):
    __slots__ = ("slot", "epoch", "owner_id", "owner_addr")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    OWNER_ID_FIELD_NUMBER: _ClassVar[int]
    OWNER_ADDR_FIELD_NUMBER: _ClassVar[int]
    slot: int
    epoch: int
    owner_id: str
    owner_addr: str
    def __init__(self, slot: _Optional[int] = ..., epoch: _Optional[int] = ..., owner_id: _Optional[str] = ..., owner_addr: _Optional[str] = ...) -> None: ...
