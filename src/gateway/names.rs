//! Header names of stored answers, parsed once per thread rather than on every answer.
//!
//! A stored answer keeps its headers as text (`job::Headers`), and each answer and replay
//! turns them back into a `HeaderMap`. `HeaderName::from_bytes` validates and lower-cases
//! every name, and copies every name that is not a standard header into an allocation of
//! its own: with the twenty headers OpenAI sends (`openai-processing-ms`, `x-ratelimit-*`,
//! `cf-ray`, …) that was over a third of building an answer (callgrind). The names a
//! provider sends are few and the same on every answer, so each thread keeps the ones it
//! has parsed and hands out clones, which share the name's bytes.

use std::cell::RefCell;
use std::collections::HashMap;

use http::HeaderName;

/// Names a thread keeps at most. A provider that invents a new name per answer fills it;
/// it is then emptied and filled again, which costs what parsing every name costs anyway.
const CAPACITY: usize = 512;

/// Longer names are parsed every time, not kept: real ones are short, and a provider that
/// sent long made-up ones could otherwise park up to `CAPACITY` of them in every thread.
const LONGEST_KEPT: usize = 64;

type Names = HashMap<Box<str>, HeaderName, foldhash::fast::RandomState>;

thread_local! {
    static NAMES: RefCell<Names> = RefCell::new(Names::default());
}

/// `name` as a [`HeaderName`], or `None` if it is not a valid header name.
pub(super) fn header_name(name: &str) -> Option<HeaderName> {
    if name.len() > LONGEST_KEPT {
        // Never kept, so not looked for either.
        return HeaderName::from_bytes(name.as_bytes()).ok();
    }
    NAMES.with_borrow_mut(|names| {
        if let Some(known) = names.get(name) {
            return Some(known.clone());
        }
        let parsed = HeaderName::from_bytes(name.as_bytes()).ok()?;
        if names.len() >= CAPACITY {
            names.clear();
        }
        names.insert(name.into(), parsed.clone());
        Some(parsed)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_name_is_the_same_parsed_or_kept() {
        for name in [
            "content-type",
            "openai-processing-ms",
            "x-ratelimit-limit-requests",
        ] {
            let first = header_name(name).expect("a valid name");
            let again = header_name(name).expect("a valid name");
            assert_eq!(first, HeaderName::from_bytes(name.as_bytes()).unwrap());
            assert_eq!(first, again);
            assert_eq!(again.as_str(), name);
        }
    }

    #[test]
    fn an_invalid_name_is_refused_every_time() {
        for _ in 0..2 {
            assert!(header_name("bad name").is_none());
            assert!(header_name("").is_none());
        }
        NAMES.with_borrow(|names| assert!(!names.contains_key("bad name")));
    }

    #[test]
    fn a_long_name_is_parsed_but_not_kept() {
        let long = format!("x-{}", "a".repeat(LONGEST_KEPT));
        assert_eq!(header_name(&long).unwrap().as_str(), long);
        NAMES.with_borrow(|names| assert!(!names.contains_key(long.as_str())));
        let longest = "b".repeat(LONGEST_KEPT);
        assert_eq!(header_name(&longest).unwrap().as_str(), longest);
        NAMES.with_borrow(|names| assert!(names.contains_key(longest.as_str())));
    }

    #[test]
    fn a_full_thread_starts_over_and_stays_bounded() {
        for i in 0..CAPACITY * 2 + 7 {
            let name = format!("x-made-up-{i}");
            assert_eq!(header_name(&name).unwrap().as_str(), name);
        }
        NAMES.with_borrow(|names| assert!(names.len() <= CAPACITY));
        assert_eq!(header_name("cf-ray").unwrap().as_str(), "cf-ray");
    }
}
