//! `strftime_now(format)`, the template global HF provides so templates can print today's
//! date (Llama 3.1 writes `strftime_now("%d %b %Y")` into its system prompt).
//!
//! Time is UTC: servers run in UTC and ferrolm does not read time zone data. The common C
//! directives are supported, with glibc's `-` flag for no padding (`%-d`); any other
//! directive is written out unchanged, as glibc does.

use std::time::{SystemTime, UNIX_EPOCH};

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"];

/// A UTC date and time broken into fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct CivilTime {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Monday .. 6 = Sunday
    weekday: u32,
    /// 1..=366
    day_of_year: u32,
}

impl CivilTime {
    fn from_unix(secs: i64) -> Self {
        let days = secs.div_euclid(86_400);
        let rem = secs.rem_euclid(86_400) as u32;
        let (year, month, day) = civil_from_days(days);
        let jan1 = days_from_civil(year, 1, 1);
        CivilTime {
            year,
            month,
            day,
            hour: rem / 3600,
            minute: rem / 60 % 60,
            second: rem % 60,
            // 1970-01-01 was a Thursday (3 when Monday is 0).
            weekday: (days + 3).rem_euclid(7) as u32,
            day_of_year: (days - jan1 + 1) as u32,
        }
    }
}

/// Howard Hinnant's `civil_from_days`: days since 1970-01-01 to (year, month, day).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Formats the current UTC time.
pub(crate) fn strftime_now(format: &str) -> String {
    let secs = match SystemTime::now().duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX / 2),
        Err(e) => -i64::try_from(e.duration().as_secs()).unwrap_or(0),
    };
    format_unix(secs, format)
}

fn format_unix(secs: i64, format: &str) -> String {
    let t = CivilTime::from_unix(secs);
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let Some(directive) = chars.next() else {
            out.push('%');
            if no_pad {
                out.push('-');
            }
            break;
        };
        let num = |n: i64, width: usize| {
            if no_pad {
                n.to_string()
            } else {
                format!("{n:0width$}")
            }
        };
        let hour12 = match t.hour % 12 {
            0 => 12,
            h => h,
        };
        let text = match directive {
            'Y' => t.year.to_string(),
            'y' => num(t.year.rem_euclid(100), 2),
            'm' => num(t.month.into(), 2),
            'd' => num(t.day.into(), 2),
            'e' => {
                if no_pad {
                    t.day.to_string()
                } else {
                    format!("{:>2}", t.day)
                }
            }
            'H' => num(t.hour.into(), 2),
            'I' => num(hour12.into(), 2),
            'M' => num(t.minute.into(), 2),
            'S' => num(t.second.into(), 2),
            'j' => num(t.day_of_year.into(), 3),
            'p' => if t.hour < 12 { "AM" } else { "PM" }.to_string(),
            'B' => MONTHS[(t.month - 1) as usize].to_string(),
            'b' | 'h' => MONTHS[(t.month - 1) as usize][..3].to_string(),
            'A' => WEEKDAYS[t.weekday as usize].to_string(),
            'a' => WEEKDAYS[t.weekday as usize][..3].to_string(),
            'u' => (t.weekday + 1).to_string(),
            'w' => ((t.weekday + 1) % 7).to_string(),
            'F' => format!("{}-{:02}-{:02}", t.year, t.month, t.day),
            'T' => format!("{:02}:{:02}:{:02}", t.hour, t.minute, t.second),
            'Z' => "UTC".to_string(),
            'z' => "+0000".to_string(),
            '%' => "%".to_string(),
            other => {
                if no_pad {
                    format!("%-{other}")
                } else {
                    format!("%{other}")
                }
            }
        };
        out.push_str(&text);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_instants() {
        // 2024-07-23 14:05:09 UTC, a Tuesday, day 205 of a leap year.
        let t = 1_721_743_509;
        assert_eq!(format_unix(t, "%d %b %Y"), "23 Jul 2024");
        assert_eq!(format_unix(t, "%A %B %-d, %y %I:%M:%S %p"), "Tuesday July 23, 24 02:05:09 PM");
        assert_eq!(format_unix(t, "%F %T %j %% %Q"), "2024-07-23 14:05:09 205 % %Q");
        assert_eq!(format_unix(0, "%Y-%m-%d %a %e"), "1970-01-01 Thu  1");
        // Before the epoch and across a century leap rule.
        assert_eq!(format_unix(951_782_400, "%Y-%m-%d"), "2000-02-29");
        assert_eq!(format_unix(-86_400, "%Y-%m-%d %a"), "1969-12-31 Wed");
        assert_eq!(format_unix(t, "trailing %"), "trailing %");
    }

    #[test]
    fn now_is_a_plausible_year() {
        let year: i64 = strftime_now("%Y").parse().unwrap_or(0);
        assert!(year >= 2024, "{year}");
    }
}
