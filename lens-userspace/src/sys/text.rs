//! Text read from a traced process (its name and arguments, Python function and file
//! names, symbols of the libraries it maps) is written by whoever controls that process:
//! printed raw, a `\n` would forge a line of lens-probe's own and an ESC or OSC sequence
//! would drive the reader's terminal. Such text is shown with its control characters
//! escaped, as Rust's `escape_debug` writes them (`\n`, `\u{1b}`).
use std::{borrow::Cow, fmt};

/// `text` with every control character escaped; the text itself when it has none.
pub fn printable(text: &str) -> Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return Cow::Borrowed(text);
    }
    Cow::Owned(Printable(text).to_string())
}

/// Shows a string with its control characters escaped (see the module's comment).
pub struct Printable<'a>(pub &'a str);

impl fmt::Display for Printable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_debug())?;
            } else {
                fmt::Write::write_char(f, c)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_shown_escaped_and_the_rest_as_it_is() {
        assert!(matches!(printable("train.py"), Cow::Borrowed("train.py")));
        assert_eq!(
            printable("f\nlens-probe: hang resolved"),
            "f\\nlens-probe: hang resolved"
        );
        assert_eq!(printable("\u{1b}]0;owned\u{7}x"), "\\u{1b}]0;owned\\u{7}x");
        assert_eq!(printable("\u{9b}2J"), "\\u{9b}2J");
        assert_eq!(printable("süß_λ"), "süß_λ");
        assert_eq!(Printable("a\rb").to_string(), "a\\rb");
    }
}
