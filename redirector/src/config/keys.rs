//! Every key the configuration file takes, read from serde's own view of the file (`raw.rs`): a
//! deserializer that answers each struct with all of its fields and records them. So the list
//! is the parser's, never a copy of it, and the docs and the changelog are tested against it.

use std::cell::RefCell;

use serde::{
    Deserialize as _, Deserializer,
    de::{self, DeserializeSeed, IntoDeserializer as _, MapAccess, SeqAccess, Visitor},
    forward_to_deserialize_any,
};

use super::raw::RawConfig;

type Error = de::value::Error;

/// Every key of the file as `section.key` (`key` at the top, `listener.key` for the keys of a
/// `[[listener]]`), sorted.
///
/// # Panics
/// Never for the file's types: a type the recorder cannot answer is a bug its unit test finds.
#[must_use]
pub fn keys() -> Vec<String> {
    let paths = RefCell::new(Vec::new());
    RawConfig::deserialize(Recorder {
        path: String::new(),
        paths: &paths,
    })
    .unwrap_or_else(|error| panic!("recording the configuration's keys: {error}"));
    let paths = paths.into_inner();
    // A section (`probe`) is a key only of its own keys (`probe.interval_ms`).
    let mut leaves: Vec<String> = paths
        .iter()
        .filter(|path| {
            let section = format!("{path}.");
            !paths.iter().any(|other| other.starts_with(&section))
        })
        .cloned()
        .collect();
    leaves.sort();
    leaves.dedup();
    leaves
}

/// Answers every request of a type with a value of that kind, and every struct with all of
/// its fields, recording their paths.
struct Recorder<'a> {
    path: String,
    paths: &'a RefCell<Vec<String>>,
}

impl<'a> Recorder<'a> {
    fn at(&self, key: &str) -> Recorder<'a> {
        Recorder {
            path: if self.path.is_empty() {
                key.to_owned()
            } else {
                format!("{}.{key}", self.path)
            },
            paths: self.paths,
        }
    }
}

impl<'de> Deserializer<'de> for Recorder<'_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, _visitor: V) -> Result<V::Value, Error> {
        Err(de::Error::custom(format!(
            "{}: a type the key recorder does not answer",
            self.path
        )))
    }

    fn deserialize_bool<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_bool(false)
    }

    fn deserialize_u32<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_u32(0)
    }

    fn deserialize_u64<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_u64(0)
    }

    fn deserialize_str<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_str("")
    }

    fn deserialize_string<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_str("")
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_some(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_seq(One(Some(self)))
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        let first = variants.first().copied().unwrap_or_default();
        visitor.visit_enum(first.into_deserializer())
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_map(Fields {
            recorder: self,
            fields: fields.iter(),
            current: None,
        })
    }

    forward_to_deserialize_any! {
        i8 i16 i32 i64 i128 u8 u16 u128 f32 f64 char bytes byte_buf unit unit_struct
        newtype_struct tuple tuple_struct map identifier ignored_any
    }
}

/// A sequence of one element.
struct One<'a>(Option<Recorder<'a>>);

impl<'de> SeqAccess<'de> for One<'_> {
    type Error = Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        self.0
            .take()
            .map(|recorder| seed.deserialize(recorder))
            .transpose()
    }
}

/// A struct's fields, each recorded as it is handed over.
struct Fields<'a> {
    recorder: Recorder<'a>,
    fields: std::slice::Iter<'static, &'static str>,
    current: Option<&'static str>,
}

impl<'de> MapAccess<'de> for Fields<'_> {
    type Error = Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        let Some(&field) = self.fields.next() else {
            return Ok(None);
        };
        self.current = Some(field);
        seed.deserialize(field.into_deserializer()).map(Some)
    }

    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let field = self.current.take().unwrap_or_default();
        let value = self.recorder.at(field);
        self.recorder.paths.borrow_mut().push(value.path.clone());
        seed.deserialize(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_of_the_file_is_recorded_and_only_keys() {
        let keys = keys();
        for key in [
            "cgroup",
            "kernel_log",
            "probe.interval_ms",
            "probe.upstream_timeout_ms",
            "interface.kind",
            "kubernetes.kubeconfig",
            "conntrack.bypass",
            "metrics.address",
            "listener.name",
            "listener.kube_dns",
            "listener.skip_cgroups",
        ] {
            assert!(
                keys.iter().any(|recorded| recorded == key),
                "{key}: {keys:?}"
            );
        }
        // Sections are not keys; every key is taken by the parser.
        assert!(
            !keys.iter().any(|key| key == "probe" || key == "listener"),
            "{keys:?}"
        );
        assert!(keys.len() > 35, "{keys:?}");
    }
}
