//! Kafka's rules for topic names, checked wherever a name enters onceflow (the config's
//! `application.id` and dead-letter topic, the topology's source and sink topics, the
//! internal topics derived from them). A leaf module: it depends on nothing in the crate, so
//! `config`, `kafka` and `topology` can all use it without an import circle.

/// Check a Kafka topic name: 1..=249 chars of `[a-zA-Z0-9._-]`, not `.` or `..`.
///
/// # Errors
/// A sentence saying what is wrong.
pub(crate) fn check_topic_name(t: &str) -> Result<(), String> {
    if t.is_empty() {
        return Err("topic name must not be empty".into());
    }
    if t.len() > 249 {
        return Err(format!("topic name is {} characters, at most 249", t.len()));
    }
    if t == "." || t == ".." {
        return Err(format!("{t:?} is not a valid topic name"));
    }
    if let Some(c) = t
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "topic name {t:?} holds {c:?}; use only ASCII letters, digits, '.', '_' and '-'"
        ));
    }
    Ok(())
}
