//! Schedules' times (docs/api.md, "Schedules"; issue 39): when a schedule fires, and what a
//! claim does with the firings that came due. No I/O, no clock: the store claims with these,
//! the API checks what a client gives with them.
//!
//! A cron expression is read by croner (five fields, or six with seconds; `@hourly` and the
//! like) in an IANA time zone (chrono-tz), which handles daylight saving time: a wall-clock
//! time skipped by a spring-forward fires at the first instant after the gap, one repeated
//! by a fall-back fires once.

use std::str::FromStr as _;

use chrono::{DateTime, TimeZone as _, Utc};
use chrono_tz::Tz;

/// The shortest interval of `every`.
pub const MIN_EVERY_MS: u64 = 1_000;
/// The most firings a claim runs of one schedule (the others, if more came due, are
/// skipped and said so).
pub const MAX_FIRINGS_PER_CLAIM: usize = 10;
/// The most missed firings counted one by one after downtime (more are jumped over).
const MAX_COUNTED: usize = 10_000;

/// When a schedule fires.
#[derive(Clone, Debug, PartialEq)]
pub enum When {
    /// A cron expression in a time zone.
    Cron { expr: String, tz: Tz },
    /// Every so many milliseconds, from the schedule's creation.
    Every { ms: u64, from: i64 },
    /// Once, at this time (milliseconds since the Unix epoch).
    At(i64),
}

/// What happens to firings missed while no node ran (downtime).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CatchUp {
    /// Skipped; the schedule goes on from its next time.
    None,
    /// The latest missed one runs once; the others are skipped.
    One,
}

impl CatchUp {
    pub fn parse(text: &str) -> Option<CatchUp> {
        match text {
            "none" => Some(CatchUp::None),
            "one" => Some(CatchUp::One),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CatchUp::None => "none",
            CatchUp::One => "one",
        }
    }
}

/// A time zone by its IANA name (`Europe/Paris`, `UTC`).
pub fn time_zone(name: &str) -> Result<Tz, String> {
    Tz::from_str(name).map_err(|_| format!("{name:?} is not an IANA time zone"))
}

/// A cron expression, checked.
pub fn cron(expr: &str) -> Result<croner::Cron, String> {
    if expr.len() > 128 {
        return Err("a cron expression of at most 128 bytes".into());
    }
    croner::Cron::from_str(expr).map_err(|e| format!("{expr:?} is not a cron expression: {e}"))
}

/// `every`: a duration such as `15m`, `1h30m` or `1s`, at least a second.
pub fn every(text: &str) -> Result<u64, String> {
    let duration = humantime::parse_duration(text)
        .map_err(|e| format!("{text:?} is not a duration such as 15m or 1s: {e}"))?;
    let ms = u64::try_from(duration.as_millis()).unwrap_or(u64::MAX);
    if ms < MIN_EVERY_MS {
        return Err(format!("{text:?} is under a second"));
    }
    if ms > 366 * 24 * 3600 * 1000 {
        return Err(format!("{text:?} is over a year"));
    }
    Ok(ms)
}

/// The first firing strictly after `after` (milliseconds), `None` when there is none (a
/// one-time schedule that fired, a cron expression that never matches again).
pub fn next_after(when: &When, after: i64) -> Option<i64> {
    match when {
        When::At(at) => (*at > after).then_some(*at),
        When::Every { ms, from } => {
            let ms = i64::try_from(*ms).ok()?.max(1);
            if after < *from {
                return Some(*from);
            }
            let steps = (after - from) / ms + 1;
            from.checked_add(steps.checked_mul(ms)?)
        }
        When::Cron { expr, tz } => {
            let cron = croner::Cron::from_str(expr).ok()?;
            let start = tz.timestamp_millis_opt(after).single()?;
            let next = cron.find_next_occurrence(&start, false).ok()?;
            Some(next.with_timezone(&Utc).timestamp_millis())
        }
    }
}

/// What a claim does with a schedule whose next firing (`next_fire_at`) is due at `now`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Due {
    /// The firings to run now, oldest first.
    pub fire: Vec<i64>,
    /// Firings skipped (missed by more than `late_ms`, or more than a claim runs), and the
    /// latest of them.
    pub skipped: u64,
    pub last_skipped: Option<i64>,
    /// The schedule's next firing after these; `None`: it is done.
    pub next: Option<i64>,
}

/// The firings due at `now` from `next_fire_at` on: those at most `late_ms` late run;
/// later ones (missed while no node ran) are skipped, or with `catch_up: one` the latest of
/// them runs once when nothing else does.
pub fn due(when: &When, next_fire_at: i64, now: i64, late_ms: i64, catch_up: CatchUp) -> Due {
    let mut missed = Vec::new();
    let mut at = Some(next_fire_at);
    let mut jumped = 0u64;
    while let Some(t) = at.filter(|t| *t <= now) {
        if missed.len() >= MAX_COUNTED {
            // Far behind: the rest is jumped over (and counted as one).
            jumped += 1;
            at = next_after(when, now);
            break;
        }
        missed.push(t);
        at = next_after(when, t);
    }
    let next = at;
    let (late, on_time): (Vec<i64>, Vec<i64>) = missed.into_iter().partition(|t| now - t > late_ms);
    let mut fire = on_time;
    let mut skipped_times = late;
    if fire.is_empty()
        && catch_up == CatchUp::One
        && let Some(latest) = skipped_times.pop()
    {
        fire.push(latest);
    }
    if fire.len() > MAX_FIRINGS_PER_CLAIM {
        let keep = fire.split_off(fire.len() - MAX_FIRINGS_PER_CLAIM);
        skipped_times.extend(std::mem::replace(&mut fire, keep));
    }
    skipped_times.sort_unstable();
    Due {
        fire,
        skipped: skipped_times.len() as u64 + jumped,
        last_skipped: skipped_times.last().copied(),
        next,
    }
}

/// RFC 3339 in UTC with milliseconds.
pub fn rfc3339(ms: i64) -> String {
    DateTime::from_timestamp_millis(ms)
        .unwrap_or_default()
        .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(text: &str) -> i64 {
        DateTime::parse_from_rfc3339(text)
            .expect("a time")
            .timestamp_millis()
    }

    #[test]
    fn intervals_count_from_their_start() {
        let when = When::Every {
            ms: 15 * 60_000,
            from: ms("2026-01-01T00:00:00Z"),
        };
        assert_eq!(
            next_after(&when, ms("2026-01-01T00:00:00Z")),
            Some(ms("2026-01-01T00:15:00Z"))
        );
        assert_eq!(
            next_after(&when, ms("2026-01-01T00:14:59Z")),
            Some(ms("2026-01-01T00:15:00Z"))
        );
        assert_eq!(every("15m"), Ok(900_000));
        assert_eq!(every("1s"), Ok(1000));
        assert!(every("500ms").is_err() && every("soon").is_err() && every("2y").is_err());
        assert_eq!(next_after(&When::At(10), 9), Some(10));
        assert_eq!(next_after(&When::At(10), 10), None);
    }

    /// Daylight saving time is the zone's, not ours: 02:30 in Paris does not exist on
    /// 2026-03-29 (it fires at 03:00, the first instant after the gap) and exists twice on
    /// 2026-10-25 (it fires once).
    #[test]
    fn cron_in_a_time_zone_handles_dst() {
        let tz = time_zone("Europe/Paris").expect("a zone");
        let when = When::Cron {
            expr: "30 2 * * *".into(),
            tz,
        };
        // Spring forward: 2026-03-29 02:00 CET becomes 03:00 CEST.
        assert_eq!(
            next_after(&when, ms("2026-03-28T12:00:00Z")),
            Some(ms("2026-03-29T01:00:00Z"))
        );
        // The day after: 02:30 CEST = 00:30 UTC.
        assert_eq!(
            next_after(&when, ms("2026-03-29T12:00:00Z")),
            Some(ms("2026-03-30T00:30:00Z"))
        );
        // Fall back: 2026-10-25 02:30 happens at 00:30 UTC (CEST) and 01:30 UTC (CET).
        let first = next_after(&when, ms("2026-10-24T12:00:00Z")).expect("a firing");
        let second = next_after(&when, first).expect("a firing");
        assert!(
            second >= ms("2026-10-26T00:00:00Z"),
            "fired twice on the repeated hour"
        );
        // Every 15 minutes in New York, and a bad expression or zone.
        let quarter = When::Cron {
            expr: "*/15 * * * *".into(),
            tz: time_zone("America/New_York").expect("a zone"),
        };
        assert_eq!(
            next_after(&quarter, ms("2026-06-01T10:07:00Z")),
            Some(ms("2026-06-01T10:15:00Z"))
        );
        assert!(cron("61 * * * *").is_err());
        assert!(cron("@hourly").is_ok());
        assert!(time_zone("Mars/Olympus").is_err());
    }

    #[test]
    fn a_claim_runs_what_is_due_and_skips_what_downtime_missed() {
        let when = When::Every { ms: 1000, from: 0 };
        // On time: the one due firing runs.
        assert_eq!(
            due(&when, 5000, 5100, 60_000, CatchUp::None),
            Due {
                fire: vec![5000],
                skipped: 0,
                last_skipped: None,
                next: Some(6000)
            }
        );
        // A node down for a minute: everything over late_ms is skipped...
        let after_downtime = due(&when, 1000, 61_500, 5_000, CatchUp::None);
        assert_eq!(
            after_downtime.fire,
            vec![57_000, 58_000, 59_000, 60_000, 61_000]
        );
        assert_eq!(after_downtime.skipped, 56);
        assert_eq!(after_downtime.next, Some(62_000));
        // ... and an hourly job missed for a day: none, or the latest once.
        let hourly = When::Every {
            ms: 3_600_000,
            from: 0,
        };
        let none = due(
            &hourly,
            3_600_000,
            86_400_000 + 60_000,
            5_000,
            CatchUp::None,
        );
        assert!(none.fire.is_empty());
        assert_eq!(none.skipped, 24);
        assert_eq!(none.next, Some(90_000_000));
        let one = due(&hourly, 3_600_000, 86_400_000 + 60_000, 5_000, CatchUp::One);
        assert_eq!(one.fire, vec![86_400_000]);
        assert_eq!(one.skipped, 23);
        // A one-time schedule is done once it fired.
        assert_eq!(
            due(&When::At(100), 100, 150, 5_000, CatchUp::None),
            Due {
                fire: vec![100],
                skipped: 0,
                last_skipped: None,
                next: None
            }
        );
    }
}
