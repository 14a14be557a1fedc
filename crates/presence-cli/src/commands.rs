//! The one-shot subcommands: each makes one call and prints its answer,
//! readable or as JSON.

use presence_client::pb;

use crate::connect::Connection;
use crate::exit::{Exit, Failure};
use crate::output::{print, print_json, print_pretty_json};
use crate::text::{self, Table};
use crate::{EraseArgs, ExportArgs, GetArgs, NotifyTargetsArgs, RevokeArgs, RoomArgs, SessionsArgs, StatsArgs, json};

pub(crate) async fn get(args: GetArgs) -> Result<(), Failure> {
    let mut connection = Connection::open(&args.target).await?;
    let request = connection.request(pb::SnapshotRequest { user_ids: args.users, ..Default::default() });
    let users = connection.client.snapshot(request).await?.into_inner().users;
    if args.target.json {
        print_json(&json::snapshot_response(&users))?;
        return Ok(());
    }
    let now = text::local_now_ms();
    let mut table = Table::new(&["USER", "STATE", "AVAILABILITY", "VERSION", "STATUS", "LAST ACTIVE"]);
    for user in &users {
        // The exact time for a service acting for no viewer; the coarse last seen otherwise.
        let active = if user.last_active_at_ms != 0 { user.last_active_at_ms } else { user.last_seen_ms };
        table.row(vec![
            user.user_id.clone(),
            text::state(user.state).to_owned(),
            text::availability(user.availability).to_owned(),
            user.version.to_string(),
            text::status(user.status.as_ref()),
            text::relative(now, active),
        ]);
    }
    print(&table.render())?;
    Ok(())
}

pub(crate) async fn notify_targets(args: NotifyTargetsArgs) -> Result<(), Failure> {
    let mut connection = Connection::open(&args.target).await?;
    let urgency = if args.urgent { pb::Urgency::Urgent } else { pb::Urgency::Normal };
    let request = connection.request(pb::NotifyTargetsRequest {
        user_ids: args.users,
        room_id: args.room.unwrap_or_default(),
        urgency: urgency as i32,
        handoff_ms: args.handoff_ms,
    });
    let targets = connection.client.notify_targets(request).await?.into_inner().targets;
    if args.target.json {
        print_json(&json::notify_targets(&targets))?;
        return Ok(());
    }
    let mut table = Table::new(&["USER", "PUSH", "REASON", "IN-APP SESSIONS"]);
    for target in &targets {
        let push = match (target.push_now, target.push_after_ms) {
            (true, _) => "now".to_owned(),
            (false, 0) => "no".to_owned(),
            (false, after) => format!("in {}", text::span(after)),
        };
        table.row(vec![
            target.user_id.clone(),
            push,
            text::notify_reason(target.reason).to_owned(),
            target.in_app_session_ids.join(","),
        ]);
    }
    print(&table.render())?;
    Ok(())
}

pub(crate) async fn sessions(args: SessionsArgs) -> Result<(), Failure> {
    let mut connection = Connection::open(&args.target).await?;
    let request = connection.request(pb::ListSessionsRequest { user_id: args.user.clone() });
    let listed = connection.client.list_sessions(request).await?.into_inner();
    if args.target.json {
        print_json(&json::list_sessions_response(&listed))?;
        return Ok(());
    }
    if listed.sessions.is_empty() {
        print(&format!("{} has no sessions\n", args.user))?;
        return Ok(());
    }
    let mut table = Table::new(&["SESSION", "GATEWAY", "GENERATION", "EXPIRES", "RENEWED", "ROOMS", "METADATA"]);
    for session in &listed.sessions {
        let mut expires = text::relative(listed.now_ms, session.expires_at_ms);
        if session.lingering {
            expires.push_str(" (lingering)");
        }
        table.row(vec![
            session.session_id.clone(),
            session.gateway_id.clone(),
            session.generation.to_string(),
            expires,
            text::relative(listed.now_ms, session.last_renewed_at_ms),
            text::joined(&session.rooms),
            text::metadata(&session.metadata),
        ]);
    }
    print(&table.render())?;
    Ok(())
}

pub(crate) async fn revoke(args: RevokeArgs) -> Result<(), Failure> {
    let mut connection = Connection::open(&args.target).await?;
    let session_id = args.session.clone().unwrap_or_default();
    let request = connection.request(pb::RevokeRequest { user_id: args.user.clone(), session_id });
    let revoked = connection.client.revoke(request).await?.into_inner();
    if args.target.json {
        print_json(&json::revoke_response(&revoked))?;
    } else if revoked.revoked > 0 {
        let presence = revoked.presence.clone().unwrap_or_default();
        let noun = if revoked.revoked == 1 { "session" } else { "sessions" };
        print(&format!(
            "revoked {} {noun} of {}; it is {} (version {})\n",
            revoked.revoked,
            args.user,
            text::state(presence.state),
            presence.version
        ))?;
    }
    if revoked.revoked == 0 {
        let what = match &args.session {
            Some(session) => format!("session {session:?}"),
            None => "session".to_owned(),
        };
        return Err(Failure::new(Exit::NotFound, format!("{} has no {what} to revoke", args.user)));
    }
    Ok(())
}

pub(crate) async fn room(args: RoomArgs) -> Result<(), Failure> {
    let mut connection = Connection::open(&args.target).await?;
    let request = connection.request(pb::RoomSnapshotRequest { room_id: args.room, ..Default::default() });
    let room = connection.client.room_snapshot(request).await?.into_inner();
    if args.target.json {
        print_json(&json::room_snapshot(&room))?;
        return Ok(());
    }
    let mut out =
        format!("room {}: {} users, {} sessions, version {}\n", room.room_id, room.users, room.sessions, room.version);
    if room.members_omitted {
        out.push_str("members not listed: more than the server's --room-member-cap (watch it with --count)\n");
    } else if !room.members.is_empty() {
        let mut table = Table::new(&["USER", "SESSIONS", "METADATA"]);
        for member in &room.members {
            table.row(vec![member.user_id.clone(), member.sessions.to_string(), text::metadata(&member.metadata)]);
        }
        out.push_str(&table.render());
    }
    for set in &room.signals {
        out.push_str(&signal_line(set));
        out.push('\n');
    }
    print(&out)?;
    Ok(())
}

/// Who is signalling one kind: `typing: u1,u2 (2)`.
pub(crate) fn signal_line(set: &pb::SignalSet) -> String {
    format!("{}: {} ({})", set.kind, text::joined(&set.user_ids), set.count)
}

pub(crate) async fn stats(args: StatsArgs) -> Result<(), Failure> {
    let mut connection = Connection::open(&args.target).await?;
    let request = connection.request(pb::StatsRequest {});
    let stats = connection.client.stats(request).await?.into_inner();
    if args.target.json {
        print_json(&json::stats_response(&stats))?;
        return Ok(());
    }
    print(&stats_text(&stats))?;
    Ok(())
}

/// The figures as aligned `name  value` lines, the lag histogram's non-empty buckets beneath.
fn stats_text(stats: &pb::StatsResponse) -> String {
    let mut table = Table::new(&["presenced", &format!("{}, up {}", stats.version, text::span(stats.uptime_ms))]);
    let mut line = |name: &str, value: String| table.row(vec![name.to_owned(), value]);
    line("sessions", stats.sessions.to_string());
    line("online users", stats.online_users.to_string());
    line("users held", stats.users.to_string());
    line("rooms", format!("{} ({} memberships)", stats.rooms, stats.room_memberships));
    line(
        "viewers",
        format!(
            "{} watch, {} room watch, {} room counts",
            stats.viewers, stats.room_watchers, stats.room_count_streams
        ),
    );
    if stats.relay_links + stats.relay_sessions > 0 {
        line(
            "relays",
            format!(
                "{} to other nodes ({} users relayed), {} from other nodes",
                stats.relay_links, stats.relayed_users, stats.relay_sessions
            ),
        );
    }
    line("renewals", format!("{} ({} shed)", stats.renewals_total, stats.renewals_shed_total));
    line("registers", stats.registers_total.to_string());
    line("unregisters", stats.unregisters_total.to_string());
    line("expiries", stats.expiries_total.to_string());
    let lag = stats.expiry_lag.clone().unwrap_or_default();
    let mean =
        if lag.count == 0 { "-".to_owned() } else { format!("{:.1} ms", lag.sum_seconds * 1e3 / lag.count as f64) };
    line("expiry lag", format!("{} observed, mean {mean}", lag.count));
    for (bucket, count) in lag.counts.iter().enumerate().filter(|(_, count)| **count > 0) {
        let bound = match lag.bounds_seconds.get(bucket) {
            Some(bound) => format!("  ≤ {}", seconds(*bound)),
            None => format!("  > {}", lag.bounds_seconds.last().map_or_else(String::new, |bound| seconds(*bound))),
        };
        line(&bound, count.to_string());
    }
    if let Some(ttl) = &stats.ttl {
        line("ttl", format!("min {} ms, default {} ms, max {} ms", ttl.min_ttl_ms, ttl.default_ttl_ms, ttl.max_ttl_ms));
        line(
            "heartbeat",
            format!("{} ms suggested (the default TTL then tolerates 2 lost beats)", ttl.suggested_heartbeat_ms),
        );
        line("renew throttle", format!("{} ms", ttl.min_renew_interval_ms));
        line("offline grace", format!("{} ms", ttl.offline_grace_ms));
    }
    table.render()
}

/// A bucket bound: "50 µs", "2.5 ms", "1 s".
fn seconds(bound: f64) -> String {
    if bound < 0.001 {
        format!("{} µs", (bound * 1e6).round())
    } else if bound < 1.0 {
        format!("{} ms", (bound * 1e6).round() / 1e3)
    } else {
        format!("{bound} s")
    }
}

pub(crate) async fn export(args: ExportArgs) -> Result<(), Failure> {
    let mut connection = Connection::open(&args.target).await?;
    let request = connection.request(pb::ExportUserRequest { user_id: args.user });
    let exported = connection.client.export_user(request).await?.into_inner();
    let value = json::export_user_response(&exported);
    if args.target.json {
        print_json(&value)?
    } else {
        print_pretty_json(&value)?
    };
    Ok(())
}

pub(crate) async fn erase(args: EraseArgs) -> Result<(), Failure> {
    let mut connection = Connection::open(&args.target).await?;
    let request = connection.request(pb::EraseUserRequest { user_id: args.user.clone() });
    let erased = connection.client.erase_user(request).await?.into_inner();
    if args.target.json {
        print_json(&json::erase_user_response(&erased))?;
        return Ok(());
    }
    print(&erase_text(&args.user, &erased))?;
    Ok(())
}

/// What an erase removed: a line that says whether there was anything, then one row per kind of data.
fn erase_text(user: &str, erased: &pb::EraseUserResponse) -> String {
    let yes_no = |yes: bool| if yes { "yes" } else { "no" }.to_owned();
    let anything = erased.sessions_revoked > 0
        || erased.rooms_left > 0
        || erased.status_removed
        || erased.visibility_removed
        || erased.audience_removed > 0
        || erased.removed_from_audiences > 0
        || erased.groups_left > 0
        || erased.settings_removed > 0
        || erased.activity_removed
        || erased.presence_forgotten;
    let mut out = if anything {
        format!("erased {user}: it now reads as a user never seen\n")
    } else {
        format!("{user}: nothing held, nothing erased\n")
    };
    let mut table = Table::new(&["WHAT", "REMOVED"]);
    let mut line = |name: &str, value: String| table.row(vec![name.to_owned(), value]);
    line("sessions revoked", erased.sessions_revoked.to_string());
    line("rooms left", erased.rooms_left.to_string());
    line("went offline", yes_no(erased.went_offline));
    line("status", yes_no(erased.status_removed));
    line("visibility", yes_no(erased.visibility_removed));
    line("audience (viewers it granted)", erased.audience_removed.to_string());
    line("in audiences of (users)", erased.removed_from_audiences.to_string());
    line("groups left", erased.groups_left.to_string());
    line("settings", erased.settings_removed.to_string());
    line("activity", yes_no(erased.activity_removed));
    line("presence record", yes_no(erased.presence_forgotten));
    out.push_str(&table.render());
    out
}
