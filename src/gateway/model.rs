//! The `model` a chat body names, for routes that match by model (SPEC §3 step 1).

/// The top-level `model` of a JSON object body, when it is a string; the last one when the
/// name appears more than once, as a parsed object keeps it. The rest of the body is checked
/// as JSON but skipped, not built into values: the messages of a chat body are most of it,
/// and a route that matches by model reads every request's `model`.
pub fn model_of(body: &[u8]) -> Option<std::borrow::Cow<'_, str>> {
    use std::borrow::Cow;

    use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};

    struct Model;

    impl<'de> Visitor<'de> for Model {
        type Value = Option<Cow<'de, str>>;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a JSON object")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            /// A member's value: the string it is, or anything else skipped.
            struct Text<'a>(Option<Cow<'a, str>>);

            impl<'de> serde::Deserialize<'de> for Text<'de> {
                fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                    struct V;
                    impl<'de> Visitor<'de> for V {
                        type Value = Text<'de>;
                        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                            f.write_str("any JSON value")
                        }
                        fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Text<'de>, E> {
                            Ok(Text(Some(Cow::Borrowed(v))))
                        }
                        fn visit_str<E>(self, v: &str) -> Result<Text<'de>, E> {
                            Ok(Text(Some(Cow::Owned(v.to_owned()))))
                        }
                        fn visit_string<E>(self, v: String) -> Result<Text<'de>, E> {
                            Ok(Text(Some(Cow::Owned(v))))
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
                        fn visit_seq<A: serde::de::SeqAccess<'de>>(
                            self,
                            mut seq: A,
                        ) -> Result<Text<'de>, A::Error> {
                            while seq.next_element::<IgnoredAny>()?.is_some() {}
                            Ok(Text(None))
                        }
                        fn visit_map<A: MapAccess<'de>>(
                            self,
                            mut map: A,
                        ) -> Result<Text<'de>, A::Error> {
                            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                            Ok(Text(None))
                        }
                    }
                    d.deserialize_any(V)
                }
            }

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

    let mut de = serde_json::Deserializer::from_slice(body);
    let model = de.deserialize_map(Model).ok()?;
    de.end().ok()?;
    model
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
