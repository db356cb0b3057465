//! Provider contracts (SPEC §6): what a 2xx body must hold before it may settle a job.

use crate::config::Contract;

/// Why `body` breaks the route's contract, or `None` when it holds (or there is none).
pub fn violation(contract: Option<&Contract>, body: &[u8]) -> Option<String> {
    let contract = contract?;
    if contract.json_pointers.is_empty() && contract.schema.is_none() {
        return None;
    }
    let json: serde_json::Value = match serde_json::from_slice(body) {
        Ok(json) => json,
        Err(e) => return Some(format!("contract: the body is not JSON ({e})")),
    };
    let missing: Vec<&str> = contract
        .json_pointers
        .iter()
        .filter(|p| json.pointer(p).is_none())
        .map(String::as_str)
        .collect();
    if !missing.is_empty() {
        return Some(format!("contract: missing {}", missing.join(", ")));
    }
    let schema = contract.schema.as_ref()?;
    let error = schema.validator.iter_errors(&json).next()?;
    Some(format!(
        "contract: {} at {:?} breaks {}",
        error,
        error.instance_path().to_string(),
        schema.path.display()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointers_must_all_be_present() {
        let c = Contract {
            json_pointers: vec!["/choices/0/message".into(), "/id".into()],
            schema: None,
        };
        assert_eq!(
            violation(Some(&c), br#"{"id":1,"choices":[{"message":{}}]}"#),
            None
        );
        assert_eq!(
            violation(Some(&c), br#"{"response":{"text":"hi"}}"#).unwrap(),
            "contract: missing /choices/0/message, /id"
        );
        assert!(violation(Some(&c), b"not json")
            .unwrap()
            .contains("not JSON"));
        assert_eq!(violation(None, b"anything"), None);
    }
}
