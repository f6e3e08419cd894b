//! Text helpers for what crosses the wire from hosts the server does not
//! trust (status lines, check messages).

/// Cuts `text` to at most `max` bytes, at a character boundary.
pub fn truncate_at_char_boundary(text: &mut String, max: usize) {
    if text.len() <= max {
        return;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.truncate(end);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_at_a_character_boundary() {
        let mut text = "aé".repeat(4); // 12 bytes, é is 2
        truncate_at_char_boundary(&mut text, 5);
        assert_eq!(text, "aéa");
        let mut short = "abc".to_string();
        truncate_at_char_boundary(&mut short, 5);
        assert_eq!(short, "abc");
        let mut exact = "abcde".to_string();
        truncate_at_char_boundary(&mut exact, 5);
        assert_eq!(exact, "abcde");
    }
}
