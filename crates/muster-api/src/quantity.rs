//! Quantities as people write them: numbers (`8`, `0.25`), sizes (`16GiB`)
//! and durations (`1h30m`), parsed exactly (no floating point) and formatted
//! back in the same forms.
//!
//! Parsers return the reason as text; the caller puts the field path and the
//! value in front of it.

use crate::wire::Quantity;
use std::time::Duration;

/// Why a decimal number was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DecimalError {
    NotANumber,
    Negative,
    /// More than three decimal places (finer than a thousandth).
    TooPrecise,
    TooLarge,
}

/// The text of a number as the user wrote it: a YAML/JSON number is shown in
/// plain decimal notation (never with an exponent), a string as it is.
pub(crate) fn number_text(quantity: &Quantity) -> String {
    match quantity {
        Quantity::Number(number) => {
            if let Some(value) = number.as_u64() {
                value.to_string()
            } else if let Some(value) = number.as_i64() {
                value.to_string()
            } else if let Some(value) = number.as_f64() {
                // Rust's `Display` for f64 never uses an exponent: 1e-7 is
                // "0.0000001", which the exact parser below understands.
                format!("{value}")
            } else {
                number.to_string()
            }
        }
        Quantity::Text(text) => text.clone(),
    }
}

/// Parses a non-negative decimal (`8`, `0.25`, `.5`, `2.000`) into
/// thousandths, exactly.
pub(crate) fn parse_milli(text: &str) -> Result<u64, DecimalError> {
    let text = text.trim();
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text.strip_prefix('+').unwrap_or(text)),
    };
    let (whole, fraction) = unsigned.split_once('.').unwrap_or((unsigned, ""));
    if whole.is_empty() && fraction.is_empty() {
        return Err(DecimalError::NotANumber);
    }
    if !whole.bytes().all(|byte| byte.is_ascii_digit())
        || !fraction.bytes().all(|byte| byte.is_ascii_digit())
    {
        return Err(DecimalError::NotANumber);
    }
    if negative
        && whole
            .bytes()
            .chain(fraction.bytes())
            .any(|byte| byte != b'0')
    {
        return Err(DecimalError::Negative);
    }
    let mut units: u64 = 0;
    for byte in whole.bytes() {
        units = units
            .checked_mul(10)
            .and_then(|units| units.checked_add(u64::from(byte - b'0')))
            .ok_or(DecimalError::TooLarge)?;
    }
    let mut thousandths: u64 = 0;
    for (position, byte) in fraction.bytes().enumerate() {
        let digit = u64::from(byte - b'0');
        match position {
            0 => thousandths += digit * 100,
            1 => thousandths += digit * 10,
            2 => thousandths += digit,
            _ if digit != 0 => return Err(DecimalError::TooPrecise),
            _ => {}
        }
    }
    units
        .checked_mul(1000)
        .and_then(|milli| milli.checked_add(thousandths))
        .ok_or(DecimalError::TooLarge)
}

/// Formats thousandths as the shortest decimal: 8000 → "8", 250 → "0.25".
pub(crate) fn format_milli(milli: u64) -> String {
    let whole = milli / 1000;
    let fraction = milli % 1000;
    if fraction == 0 {
        return whole.to_string();
    }
    let digits = format!("{fraction:03}");
    format!("{whole}.{}", digits.trim_end_matches('0'))
}

/// A decimal as a JSON number: an integer when whole, else a float (exact
/// enough to read back the same thousandths).
pub(crate) fn milli_quantity(milli: u64) -> Quantity {
    if milli.is_multiple_of(1000) {
        return Quantity::Number(serde_json::Number::from(milli / 1000));
    }
    match serde_json::Number::from_f64(milli as f64 / 1000.0) {
        Some(number) => Quantity::Number(number),
        None => Quantity::Text(format_milli(milli)),
    }
}

const MEMORY_ACCEPTED: &str =
    "a size like \"16GiB\", \"512MiB\", \"1TiB\" (or 16Gi, 512Mi, 1Ti), or a whole number of MiB";

/// Parses a memory size into MiB: `16GiB`, `512MiB`, `1.5GiB`, `16Gi`, or
/// a bare whole number of MiB.
pub(crate) fn parse_memory_mib(quantity: &Quantity) -> Result<u64, String> {
    let text = number_text(quantity);
    let trimmed = text.trim();
    let split = trimmed
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'))
        .unwrap_or(trimmed.len());
    let (number, unit) = trimmed.split_at(split);
    let unit = unit.trim();
    let factor: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "mib" | "mi" => 1,
        "gib" | "gi" => 1024,
        "tib" | "ti" => 1024 * 1024,
        _ if number.is_empty() => return Err(format!("expected {MEMORY_ACCEPTED}")),
        _ => {
            return Err(format!(
                "unknown unit {}; accepted: MiB, GiB, TiB (or Mi, Gi, Ti), or a whole number of MiB",
                crate::error::quote(unit)
            ));
        }
    };
    let milli = parse_milli(number).map_err(|error| match error {
        DecimalError::NotANumber => format!("expected {MEMORY_ACCEPTED}"),
        DecimalError::Negative => "must not be negative".to_string(),
        DecimalError::TooPrecise => "not a whole number of MiB".to_string(),
        DecimalError::TooLarge => "too large".to_string(),
    })?;
    let milli_mib = u128::from(milli) * u128::from(factor);
    if milli_mib % 1000 != 0 {
        return Err("not a whole number of MiB".to_string());
    }
    u64::try_from(milli_mib / 1000).map_err(|_| "too large".to_string())
}

/// Formats MiB in the largest unit that divides it: 16384 → "16GiB".
pub(crate) fn format_memory(mib: u64) -> String {
    const TIB: u64 = 1024 * 1024;
    if mib != 0 && mib.is_multiple_of(TIB) {
        format!("{}TiB", mib / TIB)
    } else if mib != 0 && mib.is_multiple_of(1024) {
        format!("{}GiB", mib / 1024)
    } else {
        format!("{mib}MiB")
    }
}

pub(crate) const DURATION_ACCEPTED: &str =
    "a duration like \"90s\", \"30m\", \"2h\", \"1d\" or \"1h30m\", or a whole number of seconds";

/// A duration in an API field or query, as the OpenAPI document states it:
/// whole seconds, or `d`, `h`, `m`, `s` parts largest first, at most 12
/// digits a part, nothing else (no spaces); the empty text is "not given".
pub const DURATION_PATTERN: &str =
    "^([0-9]{1,12}|([0-9]{1,12}d)?([0-9]{1,12}h)?([0-9]{1,12}m)?([0-9]{1,12}s)?)$";

/// Reads a duration given to the API: exactly [`DURATION_PATTERN`]
/// (`None` for the empty text).
pub fn parse_api_duration(text: &str) -> Result<Option<Duration>, String> {
    if text.is_empty() {
        return Ok(None);
    }
    let digits = |part: &str| part.bytes().take_while(u8::is_ascii_digit).count();
    let whole = digits(text);
    let fits = if whole == text.len() {
        whole <= 12
    } else {
        let mut rest = text;
        let mut last_rank = 4;
        let mut fits = true;
        while !rest.is_empty() {
            let count = digits(rest);
            let rank = match rest.as_bytes().get(count) {
                Some(b'd') => 3,
                Some(b'h') => 2,
                Some(b'm') => 1,
                Some(b's') => 0,
                _ => 4,
            };
            if count == 0 || count > 12 || rank >= last_rank {
                fits = false;
                break;
            }
            last_rank = rank;
            rest = &rest[count + 1..];
        }
        fits
    };
    if !fits {
        return Err(format!(
            "expected {DURATION_ACCEPTED} (no spaces, at most 12 digits a part)"
        ));
    }
    parse_duration_text(text).map(Some)
}

/// Parses a duration written as text (command-line flags): whole seconds
/// (`5400`), or parts with units `d`, `h`, `m`, `s`, each at most once and
/// largest first (`1d2h`, `1h30m`, `90s`).
pub fn parse_duration_text(text: &str) -> Result<Duration, String> {
    parse_duration(&Quantity::Text(text.to_string()))
}

/// Parses a duration: whole seconds (`5400`), or parts with units `d`, `h`,
/// `m`, `s`, each at most once and largest first (`1d2h`, `1h30m`, `90s`).
pub(crate) fn parse_duration(quantity: &Quantity) -> Result<Duration, String> {
    let expected = || format!("expected {DURATION_ACCEPTED}");
    if let Quantity::Number(number) = quantity {
        if let Some(seconds) = number.as_u64() {
            return Ok(Duration::from_secs(seconds));
        }
        if number.as_i64().is_some() || number.as_f64().is_some_and(|value| value < 0.0) {
            return Err("must not be negative".to_string());
        }
        return Err(expected());
    }
    let text = number_text(quantity);
    let text = text.trim();
    if text.starts_with('-') {
        return Err("must not be negative".to_string());
    }
    if !text.is_empty() && text.bytes().all(|byte| byte.is_ascii_digit()) {
        return text
            .parse::<u64>()
            .map(Duration::from_secs)
            .map_err(|_| "too large".to_string());
    }
    let mut rest = text;
    let mut total: u64 = 0;
    // Units seen so far must be larger than the next one: d > h > m > s.
    let mut last_rank = usize::MAX;
    if rest.is_empty() {
        return Err(expected());
    }
    while !rest.is_empty() {
        let digits_end = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        if digits_end == 0 {
            return Err(expected());
        }
        let (digits, after) = rest.split_at(digits_end);
        let amount: u64 = digits.parse().map_err(|_| "too large".to_string())?;
        let mut units = after.chars();
        let (rank, seconds_per_unit) = match units.next() {
            Some('d') => (3, 86_400),
            Some('h') => (2, 3_600),
            Some('m') => (1, 60),
            Some('s') => (0, 1),
            _ => return Err(expected()),
        };
        if rank >= last_rank {
            return Err(format!(
                "{}; each unit at most once, largest first",
                expected()
            ));
        }
        last_rank = rank;
        total = amount
            .checked_mul(seconds_per_unit)
            .and_then(|seconds| total.checked_add(seconds))
            .ok_or_else(|| "too large".to_string())?;
        rest = units.as_str().trim_start();
    }
    Ok(Duration::from_secs(total))
}

/// Formats a duration in whole seconds with the largest units first:
/// 5400 s → "1h30m", 0 → "0s". Fractions of a second are dropped.
pub(crate) fn format_duration(duration: Duration) -> String {
    let mut seconds = duration.as_secs();
    if seconds == 0 {
        return "0s".to_string();
    }
    let mut text = String::new();
    for (unit, size) in [("d", 86_400), ("h", 3_600), ("m", 60), ("s", 1)] {
        let count = seconds / size;
        if count > 0 {
            text.push_str(&count.to_string());
            text.push_str(unit);
            seconds %= size;
        }
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn api_durations_are_exactly_the_pattern() {
        let ok = |text: &str, seconds: u64| {
            assert_eq!(
                parse_api_duration(text),
                Ok(Some(Duration::from_secs(seconds))),
                "{text:?}"
            );
        };
        ok("90", 90);
        ok("30m", 1800);
        ok("1d2h3m4s", 93_784);
        ok("000000000001s", 1);
        ok("999999999999", 999_999_999_999);
        ok(
            "999999999999d999999999999h999999999999m999999999999s",
            90_060_999_999_909_939,
        );
        assert_eq!(parse_api_duration(""), Ok(None));
        for bad in [
            " 30m",
            "30m ",
            "1h 30m",
            "30M",
            "1m1h",
            "1h1h",
            "h",
            "1x",
            "-1s",
            "+1s",
            "1.5h",
            "1234567890123",
            "1234567890123s",
            "٣s",
            "1d2",
        ] {
            assert!(parse_api_duration(bad).is_err(), "{bad:?} is refused");
        }
    }

    fn text(value: &str) -> Quantity {
        Quantity::Text(value.to_string())
    }

    fn number(value: serde_json::Value) -> Quantity {
        match value {
            serde_json::Value::Number(number) => Quantity::Number(number),
            other => panic!("not a number: {other}"),
        }
    }

    #[test]
    fn decimals_parse_exactly_into_thousandths() {
        assert_eq!(parse_milli("8"), Ok(8000));
        assert_eq!(parse_milli("0.25"), Ok(250));
        assert_eq!(parse_milli(".5"), Ok(500));
        assert_eq!(parse_milli("2.000"), Ok(2000));
        assert_eq!(parse_milli("0.1250"), Ok(125));
        assert_eq!(parse_milli("-0"), Ok(0));
        assert_eq!(parse_milli("0.0001"), Err(DecimalError::TooPrecise));
        assert_eq!(parse_milli("-1"), Err(DecimalError::Negative));
        assert_eq!(parse_milli("abc"), Err(DecimalError::NotANumber));
        assert_eq!(parse_milli("."), Err(DecimalError::NotANumber));
        assert_eq!(parse_milli("1e3"), Err(DecimalError::NotANumber));
        assert_eq!(
            parse_milli("99999999999999999999"),
            Err(DecimalError::TooLarge)
        );
    }

    #[test]
    fn numbers_keep_their_exact_text() {
        assert_eq!(number_text(&number(serde_json::json!(0.25))), "0.25");
        assert_eq!(number_text(&number(serde_json::json!(1e-7))), "0.0000001");
        assert_eq!(number_text(&number(serde_json::json!(-3))), "-3");
    }

    #[test]
    fn thousandths_format_back() {
        for milli in [0, 1, 250, 500, 999, 1000, 1500, 8000, 123_456] {
            assert_eq!(parse_milli(&format_milli(milli)), Ok(milli), "{milli}");
            assert_eq!(
                parse_milli(&number_text(&milli_quantity(milli))),
                Ok(milli),
                "{milli}"
            );
        }
        assert_eq!(format_milli(250), "0.25");
    }

    #[test]
    fn memory_sizes() {
        assert_eq!(parse_memory_mib(&text("16GiB")), Ok(16 * 1024));
        assert_eq!(parse_memory_mib(&text("16 Gi")), Ok(16 * 1024));
        assert_eq!(parse_memory_mib(&text("512MiB")), Ok(512));
        assert_eq!(parse_memory_mib(&text("1.5GiB")), Ok(1536));
        assert_eq!(parse_memory_mib(&text("1TiB")), Ok(1024 * 1024));
        assert_eq!(parse_memory_mib(&text("40960")), Ok(40960));
        assert_eq!(parse_memory_mib(&number(serde_json::json!(2048))), Ok(2048));
        assert!(
            parse_memory_mib(&text("16GB"))
                .is_err_and(|reason| reason.starts_with("unknown unit \"GB\""))
        );
        assert!(parse_memory_mib(&text("0.5MiB")).is_err());
        assert!(parse_memory_mib(&text("GiB")).is_err());
        assert!(parse_memory_mib(&text("-1GiB")).is_err());
        assert!(parse_memory_mib(&text("99999999999999999TiB")).is_err());
        assert_eq!(format_memory(16 * 1024), "16GiB");
        assert_eq!(format_memory(1536), "1536MiB");
        assert_eq!(format_memory(2 * 1024 * 1024), "2TiB");
        assert_eq!(format_memory(0), "0MiB");
    }

    #[test]
    fn durations() {
        let secs = |value: &str| parse_duration(&text(value)).map(|d| d.as_secs());
        assert_eq!(secs("90s"), Ok(90));
        assert_eq!(secs("30m"), Ok(1800));
        assert_eq!(secs("2h"), Ok(7200));
        assert_eq!(secs("1d"), Ok(86_400));
        assert_eq!(secs("1h30m"), Ok(5400));
        assert_eq!(secs("1h 30m"), Ok(5400));
        assert_eq!(secs("1d2h3m4s"), Ok(93_784));
        assert_eq!(secs("3600"), Ok(3600));
        assert_eq!(
            parse_duration(&number(serde_json::json!(120))).map(|d| d.as_secs()),
            Ok(120)
        );
        assert!(secs("1.5h").is_err());
        assert!(secs("30m1h").is_err());
        assert!(secs("1h1h").is_err());
        assert!(secs("2 hours").is_err());
        assert!(secs("").is_err());
        assert!(secs("h").is_err());
        assert!(secs("-5s").is_err_and(|reason| reason == "must not be negative"));
        assert!(secs("999999999999999999d").is_err_and(|reason| reason == "too large"));
        assert!(parse_duration(&number(serde_json::json!(-5))).is_err());
        assert!(parse_duration(&number(serde_json::json!(1.5))).is_err());
        for seconds in [0, 1, 59, 60, 90, 3600, 5400, 86_400, 93_784] {
            let formatted = format_duration(Duration::from_secs(seconds));
            assert_eq!(secs(&formatted), Ok(seconds), "{formatted}");
        }
        assert_eq!(format_duration(Duration::from_secs(5400)), "1h30m");
    }
}
