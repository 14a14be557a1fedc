//! Attention: connection is not availability (A1, A3).
//!
//! A session may say what its human is doing with it: `ACTIVE` (foreground,
//! interacting), `IDLE` (foreground, no interaction for a while) or
//! `BACKGROUND` (a hidden tab, a locked screen, an app in the background),
//! what kind of device it is on, and which room it has in focus. From the
//! attention of all of a user's live sessions, [`notify_target`] answers
//! where a notification should go: in-app to the sessions in the foreground,
//! and a push to mobile devices now, after a hand-off delay, or not at all.
//!
//! Every session's attention is 8 bytes ([`SessionAttention`]), held beside
//! its lease and ending with it. The focused room is kept as a 32-bit hash
//! of its id (FNV-1a, as slots are): a notification for another room whose
//! hash is the same, among the rooms this user's sessions focus, is answered
//! as if that room were open. One in four billion per focused room; the
//! room's name itself would cost a reference to the interned name, released
//! on every path a lease ends by.
//!
//! Pure: the caller gives the time, in milliseconds of the store's clock.

use crate::slots::slot_of;

/// The most users one `NotifyTargets` call answers for (A4).
pub const MAX_NOTIFY_USERS: usize = 1_000;

/// What a session's human is doing with it (A1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Attention {
    /// In the foreground, with interaction.
    Active,
    /// In the foreground, with no interaction for a while.
    Idle,
    /// Not seen: a hidden tab, a locked screen, an app in the background.
    Background,
}

/// The kind of device a session is on (A1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// A desktop application.
    Desktop,
    /// A phone or tablet: where pushes go.
    Mobile,
    /// A web page.
    Web,
    /// Anything else.
    Other,
}

/// A change of a session's attention, as a gateway sends it: every field
/// `None` is unchanged (a renewal that carries none costs nothing more).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttentionChange<'a> {
    /// The new attention.
    pub attention: Option<Attention>,
    /// The device kind (given at register; a later one replaces it).
    pub device: Option<DeviceKind>,
    /// The room in focus: `Some("")` clears it.
    pub focused_room_id: Option<&'a str>,
}

impl AttentionChange<'_> {
    /// Whether it changes nothing.
    pub fn is_empty(&self) -> bool {
        self.attention.is_none() && self.device.is_none() && self.focused_room_id.is_none()
    }
}

/// One session's attention, in 8 bytes: the focused room's hash (0: none),
/// and in `bits` the attention (2 bits: 0 unknown), the device kind (3 bits:
/// 0 unknown) and when it last stopped being `ACTIVE`, in seconds of the
/// store's clock rounded up (27 bits, wrapping every 4.2 years: ages are
/// taken modulo that, and a session does not live that long).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SessionAttention {
    focus: u32,
    bits: u32,
}

const ATTENTION_BITS: u32 = 0b11;
const DEVICE_SHIFT: u32 = 2;
const DEVICE_BITS: u32 = 0b111 << DEVICE_SHIFT;
const TIME_SHIFT: u32 = 5;
/// Seconds the 27 bits of time hold before they wrap.
const TIME_SPAN: u32 = 1 << (32 - TIME_SHIFT);

/// The hash a focused room is kept as: never 0, which is "none".
pub fn room_hash(room_id: &str) -> u32 {
    slot_of(room_id, u32::MAX).max(1)
}

impl SessionAttention {
    /// The attention, if the session ever said.
    pub fn attention(&self) -> Option<Attention> {
        match self.bits & ATTENTION_BITS {
            1 => Some(Attention::Active),
            2 => Some(Attention::Idle),
            3 => Some(Attention::Background),
            _ => None,
        }
    }

    /// The device kind, if the session said.
    pub fn device(&self) -> Option<DeviceKind> {
        match (self.bits & DEVICE_BITS) >> DEVICE_SHIFT {
            1 => Some(DeviceKind::Desktop),
            2 => Some(DeviceKind::Mobile),
            3 => Some(DeviceKind::Web),
            4 => Some(DeviceKind::Other),
            _ => None,
        }
    }

    /// Whether the session has the room of `hash` in focus.
    pub fn focuses(&self, hash: u32) -> bool {
        self.focus != 0 && self.focus == hash
    }

    /// Whether some room is in focus.
    pub fn has_focus(&self) -> bool {
        self.focus != 0
    }

    /// Milliseconds since the session was last `ACTIVE`, at `now_ms`: 0 while
    /// it is, `None` if it never said it was. Never more than the truth: the
    /// moment it stopped is kept rounded up to the second, so that a push
    /// held for a hand-off goes at most a second late, never early.
    pub fn inactive_for_ms(&self, now_ms: u64) -> Option<u64> {
        match self.attention() {
            Some(Attention::Active) => Some(0),
            _ if self.bits >> TIME_SHIFT == 0 => None,
            _ => {
                let span_ms = u64::from(TIME_SPAN) * 1000;
                let left_ms = u64::from(self.bits >> TIME_SHIFT) * 1000;
                let age = (now_ms % span_ms + span_ms - left_ms) % span_ms;
                // Within a second after it stopped, `left_ms` (rounded up) is still ahead.
                Some(if age > span_ms / 2 { 0 } else { age })
            }
        }
    }

    /// Applies `change` at `now_ms`: a session that stops being `ACTIVE`
    /// notes when. Returns whether anything changed.
    pub fn apply(&mut self, change: &AttentionChange<'_>, now_ms: u64) -> bool {
        let before = *self;
        if let Some(attention) = change.attention {
            if self.attention() == Some(Attention::Active) && attention != Attention::Active {
                // 0 is "never active": a session that left at second 0 of the span is noted at 1.
                let left = (now_ms.div_ceil(1000) % u64::from(TIME_SPAN)) as u32;
                self.bits = (self.bits & !(u32::MAX << TIME_SHIFT)) | (left.max(1) << TIME_SHIFT);
            }
            let code = match attention {
                Attention::Active => 1,
                Attention::Idle => 2,
                Attention::Background => 3,
            };
            self.bits = (self.bits & !ATTENTION_BITS) | code;
        }
        if let Some(device) = change.device {
            let code = match device {
                DeviceKind::Desktop => 1,
                DeviceKind::Mobile => 2,
                DeviceKind::Web => 3,
                DeviceKind::Other => 4,
            };
            self.bits = (self.bits & !DEVICE_BITS) | (code << DEVICE_SHIFT);
        }
        if let Some(room_id) = change.focused_room_id {
            self.focus = if room_id.is_empty() { 0 } else { room_hash(room_id) };
        }
        *self != before
    }
}

/// A user's availability beside ONLINE, as viewers see it (A2): derived from
/// its sessions' attention, never set by a caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activity {
    /// Some session is active, or was within the active window.
    Active,
    /// Online, and no session was active within the window.
    Away,
}

/// What a user's live sessions make its availability at `now_ms` (A2), and,
/// for an `Active` that holds only through the window after the last
/// activity, when that ends: `None` while a session is active now, and for
/// the other answers, which change only when a session does.
///
/// The window is the damping: a session that goes to the background and
/// comes back within it never shows the user `Away`. No session that says
/// what its human does is no availability at all (`None`), so a user whose
/// gateways report no attention is shown exactly as before.
pub fn derive_activity(
    sessions: impl IntoIterator<Item = SessionAttention>,
    now_ms: u64,
    window_ms: u64,
) -> (Option<Activity>, Option<u64>) {
    let (mut said, mut active_now, mut latest) = (false, false, None::<u64>);
    for session in sessions {
        said |= session.attention().is_some();
        active_now |= session.attention() == Some(Attention::Active);
        if let Some(inactive_ms) = session.inactive_for_ms(now_ms) {
            latest = Some(latest.map_or(inactive_ms, |latest| latest.min(inactive_ms)));
        }
    }
    match latest {
        _ if active_now => (Some(Activity::Active), None),
        Some(inactive_ms) if inactive_ms < window_ms => {
            (Some(Activity::Active), Some(now_ms + window_ms - inactive_ms))
        }
        _ if said => (Some(Activity::Away), None),
        _ => (None, None),
    }
}

/// How urgent a notification is (A3).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Urgency {
    /// Held back while the user attends to presenced's clients elsewhere.
    #[default]
    Normal,
    /// Always pushed at once.
    Urgent,
}

/// Why a user's notification goes where it goes (A3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotifyReason {
    /// A session has the notification's room in focus: it is seen there; no push.
    RoomOpen,
    /// A session is active, or was within the hand-off delay: in-app there;
    /// push only once the delay has passed with nobody back.
    AttendedElsewhere,
    /// No session was active within the hand-off delay: push now.
    NoAttendedSession,
    /// None of the user's sessions says what its human is doing: push now (fail open).
    UnknownFailOpen,
    /// The user has no live session: push now.
    Offline,
    /// Urgent: pushed now whatever the user attends to.
    Urgent,
}

/// The notification policy's settings (A3), with per-call overrides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotifyPolicy {
    /// How long after a session was last active a push waits (a minute after
    /// a screen locks, the user may be back at it).
    pub handoff_ms: u64,
}

impl Default for NotifyPolicy {
    /// A minute of hand-off.
    fn default() -> Self {
        NotifyPolicy { handoff_ms: 60_000 }
    }
}

/// Where one user's notification should go (A3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotifyDecision<S> {
    /// The sessions that should show it in-app now: those in the foreground
    /// (active, idle, or not saying), not those in the background.
    pub in_app: Vec<S>,
    /// Push to the user's mobile devices now.
    pub push_now: bool,
    /// When not now: push after this many milliseconds unless the user came
    /// back (0 with `push_now` false: no push at all).
    pub push_after_ms: u64,
    /// Why.
    pub reason: NotifyReason,
}

/// Where a notification for a user with these live sessions should go at
/// `now_ms`, for the room of `room_hash` if it is about one (A3). Fails open:
/// whatever presenced does not know is answered "push".
pub fn notify_target<S: Clone>(
    sessions: &[(S, SessionAttention)],
    room_hash: Option<u32>,
    urgency: Urgency,
    now_ms: u64,
    policy: &NotifyPolicy,
) -> NotifyDecision<S> {
    let in_app: Vec<S> = sessions
        .iter()
        .filter(|(_, attention)| attention.attention() != Some(Attention::Background))
        .map(|(session, _)| session.clone())
        .collect();
    let decide =
        |push_now, push_after_ms, reason| NotifyDecision { in_app: in_app.clone(), push_now, push_after_ms, reason };
    if urgency == Urgency::Urgent {
        return decide(true, 0, NotifyReason::Urgent);
    }
    if sessions.is_empty() {
        return decide(true, 0, NotifyReason::Offline);
    }
    if let Some(hash) = room_hash
        && sessions
            .iter()
            .any(|(_, attention)| attention.focuses(hash) && attention.attention() != Some(Attention::Background))
    {
        return decide(false, 0, NotifyReason::RoomOpen);
    }
    // The most recent activity of any session: 0 while one is active.
    let Some(inactive_ms) = sessions.iter().filter_map(|(_, attention)| attention.inactive_for_ms(now_ms)).min() else {
        if sessions.iter().all(|(_, attention)| attention.attention().is_none()) {
            return decide(true, 0, NotifyReason::UnknownFailOpen);
        }
        // Sessions that said, none ever active: nobody attends.
        return decide(true, 0, NotifyReason::NoAttendedSession);
    };
    if inactive_ms < policy.handoff_ms {
        return decide(false, policy.handoff_ms - inactive_ms, NotifyReason::AttendedElsewhere);
    }
    decide(true, 0, NotifyReason::NoAttendedSession)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINUTE: u64 = 60_000;

    fn session(now_ms: u64, changes: &[(u64, AttentionChange<'static>)]) -> SessionAttention {
        let mut attention = SessionAttention::default();
        for (at, change) in changes {
            assert!(*at <= now_ms);
            attention.apply(change, *at);
        }
        attention
    }

    fn change(attention: Attention, device: Option<DeviceKind>) -> AttentionChange<'static> {
        AttentionChange { attention: Some(attention), device, focused_room_id: None }
    }

    #[test]
    fn eight_bytes_per_session() {
        assert_eq!(std::mem::size_of::<SessionAttention>(), 8);
    }

    #[test]
    fn a_change_is_kept_and_fields_left_out_are_unchanged() {
        let mut attention = SessionAttention::default();
        assert_eq!((attention.attention(), attention.device(), attention.has_focus()), (None, None, false));
        assert!(attention.apply(&change(Attention::Active, Some(DeviceKind::Desktop)), 10_000));
        assert!(!attention.apply(&AttentionChange::default(), 11_000), "an empty change changes nothing");
        assert!(attention.apply(&AttentionChange { focused_room_id: Some("doc-7"), ..Default::default() }, 12_000));
        assert_eq!(attention.attention(), Some(Attention::Active));
        assert_eq!(attention.device(), Some(DeviceKind::Desktop));
        assert!(attention.focuses(room_hash("doc-7")) && !attention.focuses(room_hash("doc-8")));
        assert!(attention.apply(&AttentionChange { focused_room_id: Some(""), ..Default::default() }, 13_000));
        assert!(!attention.has_focus());
        assert_eq!(attention.inactive_for_ms(20_000), Some(0), "active now");
        attention.apply(&change(Attention::Background, None), 30_000);
        assert_eq!(attention.inactive_for_ms(45_000), Some(15_000), "left active at 30 s");
        attention.apply(&change(Attention::Idle, None), 40_000);
        assert_eq!(attention.inactive_for_ms(45_000), Some(15_000), "idle after background: still left at 30 s");
        // Kept to the second, rounded up: an age is never more than the truth.
        let mut locked = SessionAttention::default();
        locked.apply(&change(Attention::Active, None), 50_000);
        locked.apply(&change(Attention::Background, None), 50_300);
        assert_eq!(locked.inactive_for_ms(50_900), Some(0), "not yet at the rounded second");
        assert_eq!(locked.inactive_for_ms(52_300), Some(1_300), "two seconds on, 0.7 s less than true");
    }

    #[test]
    fn time_wraps_without_taking_an_age_negative() {
        let mut attention = SessionAttention::default();
        let near_wrap = (u64::from(TIME_SPAN) * 3 - 5) * 1000;
        attention.apply(&change(Attention::Active, None), near_wrap - 10_000);
        attention.apply(&change(Attention::Idle, None), near_wrap);
        assert_eq!(attention.inactive_for_ms(near_wrap + 20_000), Some(20_000));
    }

    /// Seed 000's timeline with attention: a laptop and a phone.
    #[test]
    fn a3_the_laptop_and_the_phone() {
        let policy = NotifyPolicy::default();
        let t0 = 1_000 * MINUTE;
        let laptop_active = session(t0, &[(t0 - MINUTE, change(Attention::Active, Some(DeviceKind::Desktop)))]);
        let phone_background =
            session(t0, &[(t0 - 2 * MINUTE, change(Attention::Background, Some(DeviceKind::Mobile)))]);

        // Laptop active, phone in the background: in-app on the laptop, no push now.
        let both = [("laptop", laptop_active), ("phone", phone_background)];
        let decision = notify_target(&both, None, Urgency::Normal, t0, &policy);
        assert_eq!(decision.in_app, vec!["laptop"]);
        assert_eq!(
            (decision.push_now, decision.push_after_ms, decision.reason),
            (false, MINUTE, NotifyReason::AttendedElsewhere)
        );

        // Urgent: pushed now all the same.
        let urgent = notify_target(&both, None, Urgency::Urgent, t0, &policy);
        assert_eq!((urgent.push_now, urgent.reason), (true, NotifyReason::Urgent));

        // The laptop locks (background) at t0: the push waits out the hand-off from then.
        let mut laptop_locked = laptop_active;
        laptop_locked.apply(&change(Attention::Background, None), t0);
        let locked = [("laptop", laptop_locked), ("phone", phone_background)];
        let soon = notify_target(&locked, None, Urgency::Normal, t0 + 20_000, &policy);
        assert!(soon.in_app.is_empty(), "nothing in the foreground");
        assert_eq!((soon.push_now, soon.push_after_ms, soon.reason), (false, 40_000, NotifyReason::AttendedElsewhere));
        let later = notify_target(&locked, None, Urgency::Normal, t0 + MINUTE, &policy);
        assert_eq!((later.push_now, later.reason), (true, NotifyReason::NoAttendedSession));

        // The laptop's lease expires: its session is gone, push at once.
        let gone = notify_target(&[("phone", phone_background)], None, Urgency::Normal, t0 + 1_000, &policy);
        assert_eq!((gone.push_now, gone.reason), (true, NotifyReason::NoAttendedSession));

        // The room open on the laptop: no push for that room on any device, a push still for another.
        let mut laptop_in_room = laptop_active;
        laptop_in_room.apply(&AttentionChange { focused_room_id: Some("doc-7"), ..Default::default() }, t0);
        let room = [("laptop", laptop_in_room), ("phone", phone_background)];
        let open = notify_target(&room, Some(room_hash("doc-7")), Urgency::Normal, t0 + 5 * MINUTE, &policy);
        assert_eq!((open.push_now, open.push_after_ms, open.reason), (false, 0, NotifyReason::RoomOpen));
        let other = notify_target(&room, Some(room_hash("doc-8")), Urgency::Normal, t0, &policy);
        assert_eq!(other.reason, NotifyReason::AttendedElsewhere);
        // A room focused on a locked laptop is not open.
        let mut locked_in_room = laptop_in_room;
        locked_in_room.apply(&change(Attention::Background, None), t0);
        let hidden = notify_target(
            &[("laptop", locked_in_room)],
            Some(room_hash("doc-7")),
            Urgency::Normal,
            t0 + 2 * MINUTE,
            &policy,
        );
        assert_eq!(hidden.reason, NotifyReason::NoAttendedSession);
    }

    #[test]
    fn a3_what_presenced_does_not_know_is_pushed() {
        let policy = NotifyPolicy { handoff_ms: 30_000 };
        let offline = notify_target::<&str>(&[], None, Urgency::Normal, 0, &policy);
        assert_eq!((offline.push_now, offline.reason), (true, NotifyReason::Offline));
        // A gateway that says nothing of attention: its session gets it in-app, and a push.
        let silent = notify_target(&[("tab", SessionAttention::default())], None, Urgency::Normal, 0, &policy);
        assert_eq!(silent.in_app, vec!["tab"]);
        assert_eq!((silent.push_now, silent.reason), (true, NotifyReason::UnknownFailOpen));
        // Sessions that said, and never were active: nobody attends.
        let idle = session(0, &[(0, change(Attention::Idle, Some(DeviceKind::Web)))]);
        let never = notify_target(&[("tab", idle)], None, Urgency::Normal, 5_000, &policy);
        assert_eq!((never.push_now, never.reason), (true, NotifyReason::NoAttendedSession));
        assert_eq!(never.in_app, vec!["tab"], "idle is in the foreground");
    }

    #[test]
    fn a2_active_while_a_session_is_and_through_the_window_after_then_away() {
        let window = MINUTE;
        let active = session(0, &[(0, change(Attention::Active, None))]);
        assert_eq!(derive_activity([active], 10_000, window), (Some(Activity::Active), None), "no end while active");
        // The laptop locks at 10 s: active a window longer, to the second rounded up.
        let mut locked = active;
        locked.apply(&change(Attention::Background, None), 10_000);
        assert_eq!(derive_activity([locked], 20_000, window), (Some(Activity::Active), Some(70_000)));
        assert_eq!(derive_activity([locked], 70_000, window), (Some(Activity::Away), None), "away at the end");
        // A second session active now keeps the user active, with no end.
        assert_eq!(derive_activity([locked, active], 90_000, window), (Some(Activity::Active), None));
        // The most recent activity of any session sets the end.
        let mut later = active;
        later.apply(&change(Attention::Idle, None), 40_000);
        assert_eq!(derive_activity([locked, later], 50_000, window), (Some(Activity::Active), Some(100_000)));
    }

    #[test]
    fn a2_a_quick_switch_never_shows_away_and_no_window_shows_it_at_once() {
        let mut tab = session(0, &[(0, change(Attention::Active, None))]);
        tab.apply(&change(Attention::Background, None), 5_000);
        assert_eq!(derive_activity([tab], 6_000, MINUTE).0, Some(Activity::Active), "within the window");
        tab.apply(&change(Attention::Active, None), 8_000);
        assert_eq!(derive_activity([tab], 8_000, MINUTE), (Some(Activity::Active), None));
        // A window of 0 is no damping: away as soon as nothing is active.
        tab.apply(&change(Attention::Background, None), 9_000);
        assert_eq!(derive_activity([tab], 9_000, 0), (Some(Activity::Away), None));
    }

    #[test]
    fn a2_sessions_that_say_nothing_give_no_availability() {
        assert_eq!(derive_activity([SessionAttention::default(); 2], 0, MINUTE), (None, None));
        assert_eq!(derive_activity([], 0, MINUTE), (None, None));
        // Said, never active: away; beside a silent session too.
        let background = session(0, &[(0, change(Attention::Background, Some(DeviceKind::Mobile)))]);
        assert_eq!(derive_activity([SessionAttention::default(), background], 0, MINUTE), (Some(Activity::Away), None));
        // A device kind alone says nothing of attention.
        let phone = session(0, &[(0, AttentionChange { device: Some(DeviceKind::Mobile), ..Default::default() })]);
        assert_eq!(derive_activity([phone], 0, MINUTE), (None, None));
    }
}
