//! Kafka's rules for topic names, checked wherever a name enters onceflow (the config's
//! `application.id` and dead-letter topic, the topology's source and sink topics, the
//! internal topics derived from them), and the nearest known name to a misspelt one (the
//! "did you mean" of config keys, topology fields and stage kinds). A leaf module: it depends on nothing in the crate, so
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

/// The name among `known` nearest to `name` in edits, if it is within a third of the longer
/// one's length (`ttll` finds `ttl`, `bootstrap.server` finds `bootstrap.servers`), else
/// `None`. Ties go to the name that sorts first.
pub(crate) fn nearest<'a>(name: &str, known: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    known
        .into_iter()
        .map(|k| (edit_distance(name, k), k))
        .min()
        .filter(|(d, k)| *d <= k.len().max(name.len()) / 3)
        .map(|(_, k)| k)
}

/// Levenshtein distance in bytes.
fn edit_distance(a: &str, b: &str) -> usize {
    let b = b.as_bytes();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.bytes().enumerate() {
        let mut diag = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (diag + usize::from(ca != *cb))
                .min(row[j] + 1)
                .min(row[j + 1] + 1);
            diag = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}
