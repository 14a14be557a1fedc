//! `presenced watch`: users or a room, live, one line per change, until
//! interrupted. The reconnecting watchers are presence-client's (backoff with
//! jitter, resume by version, resyncs); this module only prints what they
//! report, and after a resync only what changed.

use std::collections::{BTreeMap, HashMap};

use presence_client::{Backoff, RoomCountWatcher, RoomWatcher, RoomWatcherEvent, Watcher, WatcherEvent, pb};
use serde_json::json;
use tonic::Code;

use crate::commands::signal_line;
use crate::connect::Connection;
use crate::exit::{Exit, Failure};
use crate::output::{Reader, print, print_json};
use crate::text;
use crate::{WatchArgs, json};

pub(crate) async fn watch(args: WatchArgs) -> Result<(), Failure> {
    // Checked here: clap lets `requires` pass when users are named, as they
    // conflict with the room `--count` needs.
    if args.count && args.room.is_none() {
        return Err(Failure::new(Exit::Usage, "--count needs --room ROOM"));
    }
    // Listening from now on: an interrupt that comes once the first lines are
    // out must end the watch cleanly, not kill the process mid-line.
    let interrupted = interrupted()?;
    tokio::pin!(interrupted);
    let connection = Connection::open(&args.target).await?;
    let json = args.target.json;
    let watching = async {
        match &args.room {
            Some(room) if args.count => watch_count(&connection, room, json).await,
            Some(room) => watch_room(&connection, room, json).await,
            None => watch_users(&connection, args.users.clone(), json).await,
        }
    };
    tokio::select! {
        ended = watching => ended,
        () = &mut interrupted => Ok(()),
    }
}

/// Completes on the first SIGINT or SIGTERM (Ctrl-C elsewhere).
pub(crate) fn interrupted() -> Result<impl Future<Output = ()>, Failure> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let cannot = |err: std::io::Error| Failure::new(Exit::Failed, format!("cannot listen for signals: {err}"));
        let (mut interrupt, mut terminate) =
            (signal(SignalKind::interrupt()).map_err(cannot)?, signal(SignalKind::terminate()).map_err(cannot)?);
        Ok(async move {
            tokio::select! {
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}

/// A user's line in a stream: `20:51:03.120  u1  ONLINE  version 1856…`.
fn user_line(user: &pb::UserPresence, width: usize) -> String {
    let status = match &user.status {
        Some(status) => format!("  {}", text::status(Some(status))),
        None => String::new(),
    };
    let status = match text::availability(user.availability) {
        "-" => status,
        availability => format!("  {availability}{status}"),
    };
    format!(
        "{}  {:<width$}  {:<7}  version {}{status}\n",
        text::clock(text::local_now_ms()),
        user.user_id,
        text::state(user.state),
        user.version
    )
}

async fn watch_users(connection: &Connection, user_ids: Vec<String>, json: bool) -> Result<(), Failure> {
    let request = pb::WatchRequest { user_ids: user_ids.clone(), ..Default::default() };
    let token = connection.token.as_deref();
    let mut watcher = Watcher::open_authorized(connection.client.clone(), request, Backoff::default(), token).await?;
    let width = user_ids.iter().map(|user| user.chars().count()).max().unwrap_or(0);
    // What has been printed of each user, so that a resync prints only changes.
    let mut shown: HashMap<String, u64> = HashMap::new();
    let mut resynced = true;
    loop {
        let reader = if resynced {
            let users: Vec<pb::UserPresence> =
                user_ids.iter().filter_map(|user| watcher.store().get(user)).cloned().collect();
            if json {
                print_json(&json!({ "snapshot": json::snapshot_response(&users) }))?
            } else {
                let changed = users.iter().filter(|user| shown.get(&user.user_id) != Some(&user.version));
                print(&changed.map(|user| user_line(user, width)).collect::<String>())?
            }
        } else {
            Reader::Listening
        };
        for user in watcher.store().iter() {
            shown.insert(user.user_id.clone(), user.version);
        }
        if reader == Reader::Gone {
            return Ok(());
        }
        let reader = match watcher.next().await {
            Some(WatcherEvent::Update(user)) => {
                resynced = false;
                if json {
                    print_json(&json!({ "update": json::user_presence(&user) }))?
                } else {
                    print(&user_line(&user, width))?
                }
            }
            Some(WatcherEvent::Resynced) => {
                resynced = true;
                Reader::Listening
            }
            None => return Err(ended(watcher.last_error())),
        };
        if reader == Reader::Gone {
            return Ok(());
        }
    }
}

/// Why a watch that reconnects by itself ended anyway.
fn ended(last_error: Option<&tonic::Status>) -> Failure {
    last_error.map_or_else(|| Failure::status(&tonic::Status::unavailable("the watch ended")), Failure::status)
}

/// A member's line: `20:51:03.120  JOINED  u1  sessions 1  cursor=p3`.
fn member_line(what: &str, member: &pb::RoomMember) -> String {
    format!(
        "{}  {what:<7}  {}  sessions {}  {}\n",
        text::clock(text::local_now_ms()),
        member.user_id,
        member.sessions,
        text::metadata(&member.metadata)
    )
}

async fn watch_room(connection: &Connection, room_id: &str, json: bool) -> Result<(), Failure> {
    let request = pb::WatchRoomRequest { room_id: room_id.to_owned(), ..Default::default() };
    let token = connection.token.as_deref();
    let opened = RoomWatcher::open_authorized(connection.client.clone(), request, Backoff::default(), token).await;
    let mut watcher = match opened {
        Ok(watcher) => watcher,
        // Past the member cap the server lists no members: count instead.
        Err(status) if status.code() == Code::FailedPrecondition => {
            eprintln!("presenced: {}; watching the counts", status.message());
            return watch_count(connection, room_id, json).await;
        }
        Err(status) => return Err(status.into()),
    };
    // The members as printed, so that a resync prints only what changed.
    let mut shown: BTreeMap<String, pb::RoomMember> = BTreeMap::new();
    if !json {
        // Says the watch is open, even for a room with nobody in it yet.
        let view = watcher.view();
        let sessions: u32 = view.members().map(|member| member.sessions).sum();
        let (at, users, version) = (text::clock(text::local_now_ms()), view.len(), view.version());
        print(&format!("{at}  {:<7}  {room_id}: {users} users, {sessions} sessions, version {version}\n", "ROOM"))?;
    }
    let mut event = Some(RoomWatcherEvent::Resynced);
    loop {
        let reader = match event {
            Some(RoomWatcherEvent::Resynced) => {
                let view = watcher.view();
                let members: BTreeMap<String, pb::RoomMember> =
                    view.members().map(|member| (member.user_id.clone(), member.clone())).collect();
                let reader = if json {
                    let members: Vec<pb::RoomMember> = members.values().cloned().collect();
                    let snapshot = pb::RoomSnapshot {
                        room_id: view.room_id().to_owned(),
                        version: view.version(),
                        users: members.len() as u32,
                        sessions: members.iter().map(|member| member.sessions).sum(),
                        members,
                        signals: view.signals().cloned().collect(),
                        ..Default::default()
                    };
                    print_json(&json!({ "snapshot": json::room_snapshot(&snapshot) }))?
                } else {
                    print(&member_changes(&shown, &members))?
                };
                shown = members;
                reader
            }
            Some(RoomWatcherEvent::Change(change)) => {
                let member = change.member.clone().unwrap_or_default();
                match pb::RoomChangeKind::try_from(change.kind) {
                    Ok(pb::RoomChangeKind::RoomChangeLeft) => shown.remove(&member.user_id),
                    _ => shown.insert(member.user_id.clone(), member.clone()),
                };
                if json {
                    print_json(&json!({ "change": json::room_member_change(&change) }))?
                } else {
                    let kind = pb::RoomChangeKind::try_from(change.kind).map_or("CHANGED", change_word);
                    print(&member_line(kind, &member))?
                }
            }
            Some(RoomWatcherEvent::Signals(set)) => {
                if json {
                    print_json(&json!({ "signals": json::signal_set(&set) }))?
                } else {
                    print(&format!("{}  {:<7}  {}\n", text::clock(text::local_now_ms()), "SIGNALS", signal_line(&set)))?
                }
            }
            None => return Err(ended(watcher.last_error())),
        };
        if reader == Reader::Gone {
            return Ok(());
        }
        event = watcher.next().await;
    }
}

fn change_word(kind: pb::RoomChangeKind) -> &'static str {
    match kind {
        pb::RoomChangeKind::RoomChangeJoined => "JOINED",
        pb::RoomChangeKind::RoomChangeLeft => "LEFT",
        _ => "UPDATED",
    }
}

/// The lines that take a reader from the members `before` to those `after`:
/// everyone at the start, only the differences after a resync.
fn member_changes(before: &BTreeMap<String, pb::RoomMember>, after: &BTreeMap<String, pb::RoomMember>) -> String {
    let mut lines = String::new();
    for (user, member) in after {
        match before.get(user) {
            None if before.is_empty() => lines.push_str(&member_line("MEMBER", member)),
            None => lines.push_str(&member_line("JOINED", member)),
            Some(old) if old != member => lines.push_str(&member_line("UPDATED", member)),
            Some(_) => {}
        }
    }
    for (user, member) in before {
        if !after.contains_key(user) {
            lines.push_str(&member_line("LEFT", member));
        }
    }
    lines
}

async fn watch_count(connection: &Connection, room_id: &str, json: bool) -> Result<(), Failure> {
    let request = pb::WatchRoomRequest { room_id: room_id.to_owned(), ..Default::default() };
    let token = connection.token.as_deref();
    let mut watcher =
        RoomCountWatcher::open_authorized(connection.client.clone(), request, Backoff::default(), token).await?;
    let mut count = Some(watcher.latest().clone());
    loop {
        let Some(latest) = count else { return Err(ended(watcher.last_error())) };
        let reader = if json {
            print_json(&json!({ "count": json::room_count(&latest) }))?
        } else {
            let at = text::clock(text::local_now_ms());
            print(&format!("{at}  {:<7}  {} users, {} sessions\n", "COUNT", latest.users, latest.sessions))?
        };
        if reader == Reader::Gone {
            return Ok(());
        }
        count = watcher.next().await;
    }
}
