//! The `model` a chat body names, for routes that match by model (SPEC §3 step 1).

use std::borrow::Cow;
use std::fmt;

use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// The top-level `model` of a JSON object body, when it is a string; the last one when the
/// name appears more than once, as a parsed object keeps it. The rest of the body is checked
/// as JSON but skipped, not built into values: the messages of a chat body are most of it,
/// and a route that matches by model reads every request's `model`.
pub fn model_of(body: &[u8]) -> Option<Cow<'_, str>> {
    let mut de = serde_json::Deserializer::from_slice(body);
    let model = de.deserialize_map(Model).ok()?;
    de.end().ok()?;
    model
}

/// The body's members, all skipped but `model`.
struct Model;

impl<'de> Visitor<'de> for Model {
    type Value = Option<Cow<'de, str>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut model = None;
        while let Some(name) = map.next_key::<Cow<'de, str>>()? {
            if name == "model" {
                model = map.next_value::<Text<'de>>()?.0;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(model)
    }
}

/// A member's value: the string it is, or `None` for any other value, skipped.
struct Text<'a>(Option<Cow<'a, str>>);

impl<'de> Deserialize<'de> for Text<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(TextVisitor)
    }
}

struct TextVisitor;

impl<'de> Visitor<'de> for TextVisitor {
    type Value = Text<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Text<'de>, E> {
        Ok(Text(Some(Cow::Borrowed(v))))
    }

    // A string with escapes arrives unescaped in a scratch buffer.
    fn visit_str<E>(self, v: &str) -> Result<Text<'de>, E> {
        Ok(Text(Some(Cow::Owned(v.to_owned()))))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Text<'de>, E> {
        Ok(Text(None))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Text<'de>, E> {
        Ok(Text(None))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Text<'de>, E> {
        Ok(Text(None))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Text<'de>, E> {
        Ok(Text(None))
    }

    fn visit_unit<E>(self) -> Result<Text<'de>, E> {
        Ok(Text(None))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Text<'de>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Text(None))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Text<'de>, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(Text(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `serde_json::Value` made of each body, `get("model")` as a string: the one
    /// reading a model route had before it skipped what it does not need.
    #[test]
    fn a_body_names_its_model_as_a_parsed_object_would() {
        let cases: &[(&str, Option<&str>)] = &[
            (
                r#"{"model":"gpt-4o","messages":[{"role":"user","content":"hi"}]}"#,
                Some("gpt-4o"),
            ),
            (
                r#"{"messages":[{"model":"inner"}],"model":"outer"}"#,
                Some("outer"),
            ),
            (r#"{"model":"first","model":"last"}"#, Some("last")),
            (r#"{"model":"named","model":7}"#, None),
            (r#"{"model":"gpt-\u00e9"}"#, Some("gpt-\u{e9}")),
            (r#"{"model":null}"#, None),
            (r#"{"model":["gpt-4o"]}"#, None),
            (r#"{"messages":[]}"#, None),
            (r#"["model","gpt-4o"]"#, None),
            (r#""gpt-4o""#, None),
            (r#"{"model":"gpt-4o"} trailing"#, None),
            (r#"{"model":"gpt-4o","x":[1,}"#, None),
            (" {\"model\" : \"spaced\"}\n", Some("spaced")),
            ("", None),
        ];
        for (body, expected) in cases {
            let old = serde_json::from_slice::<serde_json::Value>(body.as_bytes())
                .ok()
                .and_then(|v| v.get("model").and_then(|m| m.as_str().map(str::to_owned)));
            assert_eq!(old.as_deref(), *expected, "the reference reading of {body}");
            assert_eq!(model_of(body.as_bytes()).as_deref(), *expected, "{body}");
        }
    }
}
