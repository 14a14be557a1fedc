//! The readable form of answers: aligned columns, ONLINE/OFFLINE, and times
//! as "3 s ago" or "in 44 s" from the reader's point of view.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

use presence_client::pb;

/// Rows under a header, each column as wide as its widest cell; the last
/// column is not padded, so no line ends in spaces.
#[derive(Debug)]
pub(crate) struct Table {
    rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn new(header: &[&str]) -> Self {
        Table { rows: vec![header.iter().map(|cell| (*cell).to_owned()).collect()] }
    }

    pub(crate) fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    pub(crate) fn render(&self) -> String {
        let columns = self.rows.iter().map(Vec::len).max().unwrap_or(0);
        let widths: Vec<usize> = (0..columns)
            .map(|column| self.rows.iter().filter_map(|row| row.get(column)).map(|c| c.chars().count()).max())
            .map(Option::unwrap_or_default)
            .collect();
        let mut out = String::new();
        for row in &self.rows {
            let mut line = String::new();
            for (column, cell) in row.iter().enumerate() {
                if column + 1 == row.len() {
                    line.push_str(cell);
                } else {
                    let _ = write!(line, "{cell:<width$}  ", width = widths[column]);
                }
            }
            out.push_str(line.trim_end());
            out.push('\n');
        }
        out
    }
}

/// Now on this machine's clock, Unix ms: for answers that carry no server time.
pub(crate) fn local_now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| i64::try_from(since.as_millis()).unwrap_or(0))
}

/// `at_ms` seen from `now_ms`: "3 s ago", "in 44 s", or "-" for 0 (not known).
pub(crate) fn relative(now_ms: i64, at_ms: i64) -> String {
    if at_ms == 0 {
        return "-".to_owned();
    }
    let ahead = at_ms - now_ms;
    if ahead > 0 { format!("in {}", span(ahead.unsigned_abs())) } else { format!("{} ago", span(ahead.unsigned_abs())) }
}

/// A duration in the largest unit that keeps it at least 1: "850 ms", "3 s", "12 min", "5 h", "2 d".
pub(crate) fn span(ms: u64) -> String {
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..60_000 => format!("{} s", ms / 1_000),
        60_000..3_600_000 => format!("{} min", ms / 60_000),
        3_600_000..172_800_000 => format!("{} h", ms / 3_600_000),
        _ => format!("{} d", ms / 86_400_000),
    }
}

/// The time of day of `ms` (UTC), for the lines of a stream: "20:51:03.120".
pub(crate) fn clock(ms: i64) -> String {
    let ms_of_day = ms.rem_euclid(86_400_000);
    let (hours, minutes) = (ms_of_day / 3_600_000, ms_of_day / 60_000 % 60);
    format!("{hours:02}:{minutes:02}:{:02}.{:03}", ms_of_day / 1_000 % 60, ms_of_day % 1_000)
}

/// `ms` as a UTC date and time, for events that may be days old: "2026-12-05 18:33:31.080".
pub(crate) fn date_time(ms: i64) -> String {
    let (year, month, day) = civil_date(ms.div_euclid(86_400_000));
    format!("{year:04}-{month:02}-{day:02} {}", clock(ms))
}

/// The proleptic Gregorian date `days` after 1970-01-01 (H. Hinnant's
/// `civil_from_days`: whole 400-year eras, then the year, from March on so
/// that a leap day ends its year).
fn civil_date(days: i64) -> (i64, i64, i64) {
    let shifted = days + 719_468; // from 0000-03-01
    let era = shifted.div_euclid(146_097);
    let day_of_era = shifted.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_from_march = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * month_from_march + 2) / 5 + 1;
    let month = if month_from_march < 10 { month_from_march + 3 } else { month_from_march - 9 };
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

pub(crate) fn state(code: i32) -> &'static str {
    match pb::State::try_from(code) {
        Ok(pb::State::Online) => "ONLINE",
        Ok(pb::State::Offline) => "OFFLINE",
        _ => "UNKNOWN",
    }
}

/// A user's derived availability (A2): "active", "away", or "-" when it has
/// none (offline, no session says, or not shared).
pub(crate) fn availability(code: i32) -> &'static str {
    match pb::Availability::try_from(code) {
        Ok(pb::Availability::Active) => "active",
        Ok(pb::Availability::Away) => "away",
        _ => "-",
    }
}

/// Why a notification goes where it goes (A3), in a word or two.
pub(crate) fn notify_reason(code: i32) -> &'static str {
    match pb::NotifyReason::try_from(code) {
        Ok(pb::NotifyReason::RoomOpen) => "room open",
        Ok(pb::NotifyReason::AttendedElsewhere) => "attended elsewhere",
        Ok(pb::NotifyReason::NoAttendedSession) => "no attended session",
        Ok(pb::NotifyReason::UnknownFailOpen) => "unknown (fail open)",
        Ok(pb::NotifyReason::Offline) => "offline",
        Ok(pb::NotifyReason::Urgent) => "urgent",
        _ => "unknown",
    }
}

/// A user's status in a few words: `away "lunch"`, or "-" for none.
pub(crate) fn status(status: Option<&pb::Status>) -> String {
    let Some(status) = status else { return "-".to_owned() };
    let availability = match pb::Availability::try_from(status.availability) {
        Ok(pb::Availability::Available) => "available",
        Ok(pb::Availability::Away) => "away",
        Ok(pb::Availability::DoNotDisturb) => "do-not-disturb",
        _ => "unknown",
    };
    if status.text.is_empty() { availability.to_owned() } else { format!("{availability} {:?}", status.text) }
}

/// Metadata as `key=value` pairs sorted by key, or "-" for none.
pub(crate) fn metadata(entries: &HashMap<String, String>) -> String {
    if entries.is_empty() {
        return "-".to_owned();
    }
    let mut pairs: Vec<String> = entries.iter().map(|(key, value)| format!("{key}={value}")).collect();
    pairs.sort_unstable();
    pairs.join(",")
}

/// A list as `a,b,c`, or "-" for none.
pub(crate) fn joined(items: &[String]) -> String {
    if items.is_empty() { "-".to_owned() } else { items.join(",") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn o4_columns_align_and_lines_end_without_spaces() {
        let mut table = Table::new(&["USER", "STATE"]);
        table.row(vec!["a-long-user".into(), "ONLINE".into()]);
        table.row(vec!["u".into(), "-".into()]);
        assert_eq!(table.render(), "USER         STATE\na-long-user  ONLINE\nu            -\n");
    }

    #[test]
    fn o4_times_read_as_ago_and_in() {
        assert_eq!(relative(10_000, 7_000), "3 s ago");
        assert_eq!(relative(10_000, 54_000), "in 44 s");
        assert_eq!(relative(10_000, 0), "-");
        assert_eq!(span(90_000), "1 min");
        assert_eq!(span(7_200_000), "2 h");
        assert_eq!(span(3 * 86_400_000), "3 d");
        assert_eq!(clock(86_400_000 + 3_723_004), "01:02:03.004");
        assert_eq!(date_time(0), "1970-01-01 00:00:00.000");
        assert_eq!(date_time(951_782_400_000), "2000-02-29 00:00:00.000", "a leap day");
        assert_eq!(date_time(1_796_495_611_080), "2026-12-05 18:33:31.080");
        assert_eq!(date_time(-1), "1969-12-31 23:59:59.999");
    }
}
