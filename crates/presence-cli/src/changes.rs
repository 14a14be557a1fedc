//! `presenced changes`: the change feed (F1, F2) in the terminal, one line
//! per flip, status change, room occupancy change or gap, each with its
//! cursor in the form `--from` takes, until interrupted. The resumable
//! consumer is presence-client's (batches, reconnects after the last
//! cursor, OUT_OF_RANGE with the oldest cursor); with `--cursor-file` it
//! starts after the cursor the file holds and saves each batch's cursor
//! there once the batch is printed.

use clap::ValueEnum;
use presence_client::pb::change_event::Event;
use presence_client::{
    ChangeBatch, ChangesConfig, ChangesConsumer, ChangesError, CursorStore, FileCursorStore, MemoryCursorStore,
    cursor_from_hex, cursor_to_hex, pb,
};
use serde_json::json;

use crate::ChangesArgs;
use crate::connect::Connection;
use crate::exit::{Exit, Failure};
use crate::output::{Reader, print, print_json};
use crate::text;
use crate::watch::interrupted;

/// Where `--from` starts the feed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Start {
    Now,
    Oldest,
    After(Vec<u8>),
}

/// `--from`: `now`, `oldest`, or a cursor as printed.
pub(crate) fn start(text: &str) -> Result<Start, String> {
    match text {
        "now" => Ok(Start::Now),
        "oldest" => Ok(Start::Oldest),
        cursor => cursor_from_hex(cursor)
            .map(Start::After)
            .map_err(|err| format!("{err}; give `now`, `oldest`, or a cursor as `presenced changes` prints it")),
    }
}

/// `--kind`: the kinds of change a feed may be asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Kind {
    /// A user went ONLINE or OFFLINE.
    Flip,
    /// A user's status changed.
    Status,
    /// A room became occupied or empty.
    RoomOccupancy,
    /// A user's derived availability (active, away) changed.
    Availability,
}

impl Kind {
    fn wire(self) -> pb::ChangeKind {
        match self {
            Kind::Flip => pb::ChangeKind::Flip,
            Kind::Status => pb::ChangeKind::Status,
            Kind::RoomOccupancy => pb::ChangeKind::RoomOccupancy,
            Kind::Availability => pb::ChangeKind::Availability,
        }
    }
}

pub(crate) async fn changes(args: ChangesArgs) -> Result<(), Failure> {
    // Listening from now on: an interrupt ends the feed between batches'
    // lines, never in the middle of one.
    let interrupted = interrupted()?;
    tokio::pin!(interrupted);
    // A cursor file that cannot be written is a usage error found now, not
    // once the first batch is printed.
    let saved = match &args.cursor_file {
        Some(path) => saved_cursor(path).await?,
        None => None,
    };
    let connection = Connection::open(&args.target).await?;
    let starts = where_it_starts(&args, &connection.uri, saved.as_deref());
    let (from, cursor) = match &args.from {
        Start::Now => (pb::ChangesFrom::Now, Vec::new()),
        Start::Oldest => (pb::ChangesFrom::Oldest, Vec::new()),
        Start::After(cursor) => (pb::ChangesFrom::Cursor, cursor.clone()),
    };
    let request = pb::ChangesRequest {
        from: from as i32,
        cursor,
        kinds: args.kinds.iter().map(|kind| kind.wire() as i32).collect(),
        id_prefix: args.prefix.clone().unwrap_or_default(),
        slots: args.slots.clone(),
    };
    let following = async {
        match &args.cursor_file {
            Some(path) => follow(&connection, request, FileCursorStore::new(path), &args, &starts).await,
            None => follow(&connection, request, MemoryCursorStore::new(), &args, &starts).await,
        }
    };
    tokio::select! {
        ended = following => ended,
        () = &mut interrupted => Ok(()),
    }
}

/// Prints every batch, then commits it, until the feed fails or the reader goes.
async fn follow<S: CursorStore>(
    connection: &Connection,
    request: pb::ChangesRequest,
    store: S,
    args: &ChangesArgs,
    starts: &str,
) -> Result<(), Failure> {
    let token = connection.token.as_deref();
    let opened =
        ChangesConsumer::open_authorized(connection.client.clone(), request, store, ChangesConfig::default(), token)
            .await;
    let mut consumer = opened.map_err(|err| match err {
        // The only store work of an open is reading the file.
        ChangesError::Store(err) => Failure::new(Exit::Usage, format!("--cursor-file: {err}")),
        err => failure(err, args),
    })?;
    if !args.quiet {
        eprintln!("{starts}");
    }
    loop {
        let batch = consumer.next_batch().await.map_err(|err| failure(err, args))?;
        let reader = if args.target.json { print_json_lines(&batch)? } else { print(&lines(&batch))? };
        if reader == Reader::Gone {
            return Ok(());
        }
        consumer.commit().await.map_err(|err| failure(err, args))?;
    }
}

/// The cursor `path` holds, if any: a usage error when the file cannot be
/// read or its directory does not exist (the first save would fail).
async fn saved_cursor(path: &std::path::Path) -> Result<Option<Vec<u8>>, Failure> {
    let unusable = |why: String| Failure::new(Exit::Usage, format!("--cursor-file {}: {why}", path.display()));
    let dir = match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => std::path::Path::new("."),
    };
    if !dir.is_dir() {
        return Err(unusable(format!("its directory {} does not exist", dir.display())));
    }
    FileCursorStore::new(path).load().await.map_err(|err| unusable(err.to_string()))
}

/// What `changes` says once connected: where the feed starts, and why.
fn where_it_starts(args: &ChangesArgs, uri: &str, saved: Option<&[u8]>) -> String {
    let from = match (&args.from, saved) {
        (Start::Now, None) => "from now (changes made from here on)".to_owned(),
        (Start::Oldest, None) => "from the oldest change the feed retains".to_owned(),
        (Start::After(cursor), None) => format!("after cursor {}", cursor_to_hex(cursor)),
        (given, Some(cursor)) => {
            let path = args.cursor_file.as_deref().unwrap_or(std::path::Path::new("")).display();
            let over = match given {
                Start::Now => "",
                Start::Oldest => "; the file's cursor comes before --from oldest",
                Start::After(_) => "; the file's cursor comes before --from's",
            };
            format!("resuming after cursor {} from {path}{over}", cursor_to_hex(cursor))
        }
    };
    let saving = match (&args.cursor_file, saved) {
        (Some(path), None) => format!("; saving each batch's cursor in {}", path.display()),
        _ => String::new(),
    };
    format!("presenced changes: connected to {uri}; {from}{saving}")
}

fn print_json_lines(batch: &ChangeBatch) -> Result<Reader, Failure> {
    for event in &batch.events {
        let line = json!({ "change": crate::json::change_event(event), "cursor_hex": cursor_to_hex(&event.cursor) });
        if print_json(&line)? == Reader::Gone {
            return Ok(Reader::Gone);
        }
    }
    Ok(Reader::Listening)
}

/// Why the feed stopped, in one line: OUT_OF_RANGE says where to go on from.
fn failure(err: ChangesError, args: &ChangesArgs) -> Failure {
    match err {
        ChangesError::OutOfRange { oldest_cursor, status } => {
            let oldest = cursor_to_hex(&oldest_cursor);
            let how = match &args.cursor_file {
                Some(path) => format!("write {oldest} into {}", path.display()),
                None => format!("run again with --from {oldest}"),
            };
            Failure::new(
                Exit::Invalid,
                format!("{:?}: {}; the oldest cursor is {oldest}: {how}", status.code(), status.message()),
            )
        }
        ChangesError::Refused(status) => Failure::status(&status),
        ChangesError::Store(err) => Failure::new(Exit::Failed, format!("cannot save the cursor: {err}")),
        ChangesError::Handler(err) => Failure::new(Exit::Failed, err.to_string()),
    }
}

/// A batch's lines: `2026-12-06 20:51:03.120  FLIP    u1  ONLINE  version 1856…  cursor 011a…`.
fn lines(batch: &ChangeBatch) -> String {
    batch.events.iter().map(line).collect()
}

fn line(event: &pb::ChangeEvent) -> String {
    let (kind, what) = match &event.event {
        Some(Event::Flip(user)) => {
            ("FLIP", format!("{}  {:<7}  version {}", user.user_id, text::state(user.state), user.version))
        }
        Some(Event::Status(user)) => {
            let status = text::status(user.status.as_ref());
            ("STATUS", format!("{}  {status}  version {}", user.user_id, user.version))
        }
        Some(Event::Availability(user)) => {
            let availability = text::availability(user.availability);
            ("AVAIL", format!("{}  {availability}  version {}", user.user_id, user.version))
        }
        Some(Event::RoomOccupancy(room)) => {
            let occupancy = if room.occupied { "occupied" } else { "empty" };
            ("ROOM", format!("{}  {occupancy}  version {}", room.room_id, room.version))
        }
        Some(Event::Gap(gap)) => {
            let lost = if gap.lost == 0 { "an unknown number of".to_owned() } else { gap.lost.to_string() };
            let after = cursor_to_hex(&gap.after_cursor);
            ("GAP", format!("{}: {lost} changes lost after {after}; resync from a snapshot", gap.reason))
        }
        Some(Event::Progress(_)) | None => ("-", String::new()),
    };
    format!("{}  {kind:<6}  {what}  cursor {}\n", text::date_time(event.at_ms), cursor_to_hex(&event.cursor))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f1_from_takes_now_oldest_or_a_printed_cursor() {
        assert_eq!(start("now"), Ok(Start::Now));
        assert_eq!(start("oldest"), Ok(Start::Oldest));
        assert_eq!(start("01ff"), Ok(Start::After(vec![1, 255])));
        let refused = start("yesterday").unwrap_err();
        assert!(refused.starts_with("not a cursor: "), "{refused}");
    }

    #[test]
    fn f1_each_kind_of_change_reads_as_one_line_ending_in_its_cursor() {
        let at_ms = 1_796_495_611_080;
        let user = pb::UserPresence {
            user_id: "u1".into(),
            state: pb::State::Online as i32,
            version: 7,
            ..Default::default()
        };
        let flip = pb::ChangeEvent { cursor: vec![1, 2], event: Some(Event::Flip(user)), at_ms, slot: 3 };
        assert_eq!(line(&flip), "2026-12-05 18:33:31.080  FLIP    u1  ONLINE   version 7  cursor 0102\n");
        let room = pb::RoomOccupancy { room_id: "doc-7".into(), occupied: false, version: 9 };
        let emptied = pb::ChangeEvent { cursor: vec![3], event: Some(Event::RoomOccupancy(room)), at_ms, slot: 0 };
        assert!(line(&emptied).ends_with("ROOM    doc-7  empty  version 9  cursor 03\n"), "{}", line(&emptied));
        let gap = pb::Gap { after_cursor: vec![2], reason: "restart".into(), lost: 0 };
        let gap = pb::ChangeEvent { cursor: vec![4], event: Some(Event::Gap(gap)), at_ms, slot: 0 };
        assert!(line(&gap).contains("GAP     restart: an unknown number of changes lost after 02;"), "{}", line(&gap));
    }
}
