//! Meaningful activity (contract S2): `last_active_at`, distinct from lease
//! heartbeats, moving forward only, and durable at a bounded write rate.
//!
//! A Touch updates the user's time in memory at once. The durable copy is
//! written at most once per `write_interval` (a minute by default) per user:
//! the first Touch after an interval writes through before it is
//! acknowledged; later ones within the interval are flushed when the interval
//! is up. The write rate is thus bounded by the number of active users, not by
//! how often they act, and a crash loses at most the last interval of a
//! user's activity, never an older time.

use std::sync::Arc;
use std::time::Duration;

use hashbrown::{HashMap, HashSet};
use parking_lot::Mutex;
use presence_core::{CompactString, SlotSet, Tick};
use tokio_util::sync::CancellationToken;

use crate::node::clock::StoreClock;
use crate::node::storage::durable::{DurableError, DurableStore, run_blocking};

#[derive(Debug, Clone, Copy)]
struct Entry {
    /// The latest activity seen.
    last_active_at: Tick,
    /// The latest activity known to be on disk (0: none yet).
    durable: Tick,
    /// When the durable copy was last written (0: never).
    written_at: Tick,
}

/// Activity of the users seen recently.
#[derive(Debug)]
pub(crate) struct Activity {
    recent: Mutex<HashMap<CompactString, Entry>>,
    durable: Option<Arc<DurableStore>>,
    write_interval: Tick,
    /// Without a durable store, memory is the only copy: a user idle for
    /// longer than this is forgotten, as the store forgets long-offline users
    /// (B6); 0 never forgets.
    forget_idle_after: Tick,
    /// Users whose activity was due to be written since a follower was last
    /// sent them (C4); `None` unless tracked.
    changed: Mutex<Option<HashSet<CompactString>>>,
    /// Held by a flush from the batch it takes out of memory to the end of
    /// its write, and by an erase (P7) from taking a user out of memory to
    /// the end of its own write: a flush never writes back activity of a
    /// user erased meanwhile.
    writes: tokio::sync::Mutex<()>,
}

impl Activity {
    pub(crate) fn new(durable: Option<Arc<DurableStore>>, write_interval: Duration, forget_idle_after: Tick) -> Self {
        let write_interval = u64::try_from(write_interval.as_millis()).unwrap_or(u64::MAX).max(1);
        Activity {
            recent: Mutex::new(HashMap::new()),
            durable,
            write_interval,
            forget_idle_after,
            changed: Mutex::default(),
            writes: tokio::sync::Mutex::new(()),
        }
    }

    /// Starts noting whose activity moves, for [`Activity::take_changed`] (C4).
    pub(crate) fn track_changes(&self) {
        self.changed.lock().get_or_insert_with(HashSet::new);
    }

    fn note_changed<'a>(&self, users: impl IntoIterator<Item = &'a str>) {
        if let Some(changed) = self.changed.lock().as_mut() {
            changed.extend(users.into_iter().map(CompactString::from));
        }
    }

    /// The users whose activity moved since the last call: at most once a
    /// write interval each, with the writes to disk (S2).
    pub(crate) fn take_changed(&self) -> Vec<CompactString> {
        self.changed.lock().as_mut().map(|changed| changed.drain().collect()).unwrap_or_default()
    }

    /// The activity of every user of `slots` known here, in memory or on
    /// disk, to hand over with them (C3) or copy to their follower (C4).
    pub(crate) async fn in_slots(&self, slots: &SlotSet) -> Result<Vec<(CompactString, Tick)>, DurableError> {
        let mut found: HashMap<CompactString, Tick> = HashMap::new();
        if let Some(durable) = &self.durable {
            let (durable, set) = (Arc::clone(durable), slots.clone());
            for (user, at) in run_blocking(move || durable.activity_in(&set)).await? {
                found.insert(user.into(), at);
            }
        }
        for (user, entry) in self.recent.lock().iter().filter(|(user, _)| slots.holds(user.as_bytes())) {
            let at = found.entry(user.clone()).or_default();
            *at = (*at).max(entry.last_active_at);
        }
        Ok(found.into_iter().collect())
    }

    /// Takes the activity of users handed over by another node (C3, C4):
    /// each time only moves forward. With a durable store they are on disk
    /// already (`DurableStore::replace_users`).
    pub(crate) fn take_over(&self, users: impl IntoIterator<Item = (CompactString, Tick)>, now: Tick) {
        let mut recent = self.recent.lock();
        for (user, at) in users.into_iter().filter(|(_, at)| *at > 0) {
            let on_disk = if self.durable.is_some() { at } else { 0 };
            let entry = recent.entry(user).or_insert(Entry { last_active_at: 0, durable: 0, written_at: now });
            entry.last_active_at = entry.last_active_at.max(at);
            entry.durable = entry.durable.max(on_disk);
        }
    }

    /// Held while a user's activity is erased (P7): from [`Activity::erase`]
    /// to the end of the write that deletes it on disk.
    pub(crate) async fn hold_writes(&self) -> tokio::sync::MutexGuard<'_, ()> {
        self.writes.lock().await
    }

    /// Takes `user` out of memory (P7); the caller holds [`Activity::hold_writes`]
    /// and deletes its copy on disk. Returns whether it was in memory.
    pub(crate) fn erase(&self, user: &str) -> bool {
        self.note_changed([user]);
        self.recent.lock().remove(user).is_some()
    }

    /// Forgets the users of `slots` in memory, once another node has them
    /// (their copy on disk goes with `DurableStore::forget_users`).
    pub(crate) fn release(&self, slots: &SlotSet) {
        self.recent.lock().retain(|user, _| !slots.holds(user.as_bytes()));
    }

    /// Records activity at `now`; returns the user's `last_active_at` once it is
    /// as durable as the policy promises.
    pub(crate) async fn touch(&self, user_id: &str, now: Tick) -> Result<Tick, DurableError> {
        let (last_active_at, write) = {
            let mut recent = self.recent.lock();
            let entry = recent.entry(CompactString::from(user_id)).or_insert(Entry {
                last_active_at: 0,
                durable: 0,
                written_at: 0,
            });
            entry.last_active_at = entry.last_active_at.max(now);
            let due = entry.written_at == 0 || now.saturating_sub(entry.written_at) >= self.write_interval;
            if due && self.durable.is_some() {
                entry.written_at = now;
            }
            (entry.last_active_at, due)
        };
        if write {
            self.note_changed([user_id]);
        }
        if let (true, Some(durable)) = (write, &self.durable) {
            let durable = Arc::clone(durable);
            let entries = vec![(user_id.to_owned(), last_active_at)];
            run_blocking(move || durable.record_activity(&entries)).await?;
            if let Some(entry) = self.recent.lock().get_mut(user_id) {
                entry.durable = entry.durable.max(last_active_at);
            }
        }
        Ok(last_active_at)
    }

    /// The users' `last_active_at`, from memory or from disk; 0 where unknown.
    pub(crate) async fn last_active_at<S: AsRef<str>>(&self, user_ids: &[S]) -> Result<Vec<Tick>, DurableError> {
        let mut found: Vec<Option<Tick>> = {
            let recent = self.recent.lock();
            user_ids.iter().map(|id| recent.get(id.as_ref()).map(|entry| entry.last_active_at)).collect()
        };
        let missing: Vec<String> = user_ids
            .iter()
            .zip(&found)
            .filter(|(_, known)| known.is_none())
            .map(|(id, _)| id.as_ref().to_owned())
            .collect();
        if let (false, Some(durable)) = (missing.is_empty(), &self.durable) {
            let durable = Arc::clone(durable);
            let mut stored = run_blocking(move || durable.activity(&missing)).await?.into_iter();
            for slot in found.iter_mut().filter(|known| known.is_none()) {
                *slot = stored.next().flatten();
            }
        }
        Ok(found.into_iter().map(Option::unwrap_or_default).collect())
    }

    /// Writes what is due (or, with `everything`, all that is not yet on disk),
    /// and forgets users whose durable copy is current and who were idle for
    /// two intervals. Without a durable store it only forgets users idle for
    /// longer than the forget window.
    pub(crate) async fn flush(&self, now: Tick, everything: bool) -> Result<usize, DurableError> {
        let Some(durable) = &self.durable else {
            if self.forget_idle_after > 0 {
                let window = self.forget_idle_after;
                self.recent.lock().retain(|_, entry| now.saturating_sub(entry.last_active_at) <= window);
            }
            return Ok(0);
        };
        let _writes = self.writes.lock().await;
        let batch: Vec<(String, Tick)> = {
            let mut recent = self.recent.lock();
            let interval = self.write_interval;
            recent.retain(|_, entry| {
                entry.last_active_at > entry.durable || now.saturating_sub(entry.last_active_at) < 2 * interval
            });
            recent
                .iter_mut()
                .filter(|(_, entry)| {
                    entry.last_active_at > entry.durable
                        && (everything || now.saturating_sub(entry.written_at) >= interval)
                })
                .map(|(id, entry)| {
                    entry.written_at = now;
                    (id.to_string(), entry.last_active_at)
                })
                .collect()
        };
        if batch.is_empty() {
            return Ok(0);
        }
        // The follower is sent activity as the disk is: at most once an
        // interval per user (what a takeover may lose is what a crash may).
        self.note_changed(batch.iter().map(|(id, _)| id.as_str()));
        let written = batch.len();
        let store = Arc::clone(durable);
        let entries = batch.clone();
        run_blocking(move || store.record_activity(&entries)).await?;
        let mut recent = self.recent.lock();
        for (id, at) in batch {
            if let Some(entry) = recent.get_mut(id.as_str()) {
                entry.durable = entry.durable.max(at);
            }
        }
        Ok(written)
    }
}

/// Flushes due activity a few times per interval until `stop`, then everything.
pub(crate) async fn run_flusher(activity: Arc<Activity>, clock: StoreClock, stop: CancellationToken) {
    let period = Duration::from_millis((activity.write_interval / 4).clamp(10, 15_000));
    let mut tick = tokio::time::interval(period);
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => break,
        }
        if let Err(err) = activity.flush(clock.now(), false).await {
            tracing::warn!(%err, "cannot write activity; will retry");
        }
    }
    match activity.flush(clock.now(), true).await {
        Ok(written) => tracing::info!(users = written, "activity written at shutdown"),
        Err(err) => tracing::error!(%err, "cannot write activity at shutdown"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn b6_without_a_data_directory_a_user_idle_past_the_forget_window_is_forgotten() {
        let activity = Activity::new(None, Duration::from_secs(60), 600_000);
        activity.touch("idle", 1_000).await.unwrap();
        activity.touch("busy", 1_000).await.unwrap();
        activity.touch("busy", 500_000).await.unwrap();
        activity.flush(601_000, false).await.unwrap();
        assert_eq!(activity.last_active_at(&["idle", "busy"]).await.unwrap(), [1_000, 500_000], "within the window");
        activity.flush(601_001, false).await.unwrap();
        assert_eq!(
            activity.last_active_at(&["idle", "busy"]).await.unwrap(),
            [0, 500_000],
            "idle for longer: forgotten"
        );
        assert_eq!(activity.recent.lock().len(), 1);
        let never = Activity::new(None, Duration::from_secs(60), 0);
        never.touch("u", 1).await.unwrap();
        never.flush(u64::MAX, false).await.unwrap();
        assert_eq!(never.last_active_at(&["u"]).await.unwrap(), [1], "0 never forgets");
    }

    #[tokio::test]
    async fn c4_a_follower_is_sent_activity_as_the_disk_is_at_most_once_an_interval() {
        let dir = std::env::temp_dir().join(format!("presenced-activity-follow-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let store = Arc::new(DurableStore::open(&dir.join("durable.redb")).unwrap());
        let activity = Activity::new(Some(store), Duration::from_secs(60), 0);
        activity.track_changes();
        activity.touch("ann", 1_000).await.unwrap();
        assert_eq!(activity.take_changed(), ["ann"], "the first touch is written, and sent");
        activity.touch("ann", 2_000).await.unwrap();
        activity.touch("ann", 3_000).await.unwrap();
        activity.flush(30_000, false).await.unwrap();
        assert!(activity.take_changed().is_empty(), "touches within the interval wait for it");
        activity.flush(61_000, false).await.unwrap();
        assert_eq!(activity.take_changed(), ["ann"], "the interval's last touch goes with its write");
        assert_eq!(activity.in_slots(&SlotSet::of(1, [0])).await.unwrap(), [("ann".into(), 3_000)]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
