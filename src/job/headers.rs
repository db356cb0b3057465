//! A stored answer's headers, compact: every job a store keeps holds one, and every record
//! read and replay copies it.

use std::fmt;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use serde::ser::SerializeSeq;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// An answer's header names (lower case) and raw values, in the order the provider sent
/// them. The names live in one string and the values in one buffer, with one list of where
/// each header ends in them: an answer with OpenAI's twenty headers is four allocations
/// instead of sixty-one, and a clone is three reference counts.
///
/// Serialised as the list of (name, value) pairs it holds, so what a store wrote with a
/// `Vec<(String, Bytes)>` reads back, and back again.
#[derive(Clone, PartialEq, Eq)]
pub struct Headers {
    names: Arc<str>,
    values: Bytes,
    /// Where each header's name ends in `names` and its value in `values`.
    ends: Arc<[(usize, usize)]>,
}

impl Headers {
    /// Copies `pairs` into one string of names and one buffer of values, each sized once.
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Self {
        let pairs: Vec<(&str, &[u8])> = pairs.into_iter().collect();
        let mut names = String::with_capacity(pairs.iter().map(|(name, _)| name.len()).sum());
        let mut values = BytesMut::with_capacity(pairs.iter().map(|(_, value)| value.len()).sum());
        let ends = pairs
            .into_iter()
            .map(|(name, value)| {
                names.push_str(name);
                values.extend_from_slice(value);
                (names.len(), values.len())
            })
            .collect();
        Self {
            names: names.into(),
            values: values.freeze(),
            ends,
        }
    }

    /// Each header's name and value, in order; a value shares the buffer it lives in.
    pub fn iter(&self) -> impl Iterator<Item = (&str, Bytes)> + '_ {
        self.ends
            .iter()
            .scan((0, 0), move |start, &(name_end, value_end)| {
                let (name_start, value_start) = std::mem::replace(start, (name_end, value_end));
                Some((
                    &self.names[name_start..name_end],
                    self.values.slice(value_start..value_end),
                ))
            })
    }

    /// The first value of the header `name` (lower case).
    pub fn get(&self, name: &str) -> Option<Bytes> {
        self.iter().find(|(n, _)| *n == name).map(|(_, v)| v)
    }

    pub fn len(&self) -> usize {
        self.ends.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }
}

impl Default for Headers {
    fn default() -> Self {
        Self::from_pairs(std::iter::empty())
    }
}

impl From<Vec<(String, Bytes)>> for Headers {
    fn from(pairs: Vec<(String, Bytes)>) -> Self {
        Self::from_pairs(
            pairs
                .iter()
                .map(|(name, value)| (name.as_str(), &value[..])),
        )
    }
}

impl fmt::Debug for Headers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(
                self.iter()
                    .map(|(name, value)| (name, String::from_utf8_lossy(&value).into_owned())),
            )
            .finish()
    }
}

impl Serialize for Headers {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut seq = serializer.serialize_seq(Some(self.len()))?;
        for (name, value) in self.iter() {
            seq.serialize_element(&(name, value))?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for Headers {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        Vec::<(String, Bytes)>::deserialize(deserializer).map(Self::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn list() -> Vec<(String, Bytes)> {
        [
            ("content-type", "application/json"),
            ("set-cookie", "a=1"),
            ("x-empty", ""),
            ("set-cookie", "b=2"),
            ("openai-processing-ms", "412"),
        ]
        .into_iter()
        .map(|(n, v)| (n.to_owned(), Bytes::from_static(v.as_bytes())))
        .collect()
    }

    #[test]
    fn headers_read_back_as_the_pairs_they_were_made_of() {
        let headers = Headers::from(list());
        let back: Vec<(String, Bytes)> = headers
            .iter()
            .map(|(name, value)| (name.to_owned(), value))
            .collect();
        assert_eq!(back, list());
        assert_eq!(headers.len(), 5);
        assert_eq!(headers.get("set-cookie").as_deref(), Some(&b"a=1"[..]));
        assert_eq!(headers.get("x-empty").as_deref(), Some(&b""[..]));
        assert_eq!(headers.get("retry-after"), None);
        assert!(Headers::default().is_empty());
        assert_eq!(Headers::default(), Headers::from(Vec::new()));
    }

    #[test]
    fn headers_are_stored_as_the_list_they_were() {
        // Files, Redis blobs and PostgreSQL rows written with a `Vec` must read back, and
        // what is written now must read as that `Vec`.
        let headers = Headers::from(list());
        let bytes = crate::store::encode(&headers);
        assert_eq!(bytes, crate::store::encode(&list()));
        let back: Headers = crate::store::decode(&bytes).unwrap();
        assert_eq!(back, headers);
        let as_list: Vec<(String, Bytes)> = crate::store::decode(&bytes).unwrap();
        assert_eq!(as_list, list());
        let json = serde_json::to_value(&headers).unwrap();
        assert_eq!(json, serde_json::to_value(list()).unwrap());
    }
}
