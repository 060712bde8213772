//! `onceflow reset`: the plan (internal topics, group offsets, local state) and its
//! execution, refused while instances of the group are active.

use super::*;

impl StateTools {
    /// The members of the application's consumer group (`application.id`); empty when the
    /// group has none or does not exist.
    ///
    /// # Errors
    /// The broker unreachable, or the group cannot be described within 60 s.
    pub(crate) fn active_members(&self) -> Result<Vec<Member>> {
        let client: BaseConsumer =
            crate::kafka::client_config(&self.config, &[], &Default::default())
                .create()
                .map_err(crate::kafka::config_error)?;
        let group = &self.config.application_id;
        let list = with_retries("describe group", || {
            client
                .fetch_group_list(Some(group), Duration::from_secs(30))
                .map_err(Error::kafka("describe consumer group"))
        })?;
        Ok(list
            .groups()
            .iter()
            .filter(|g| g.name() == group)
            .flat_map(|g| g.members())
            .map(|m| Member {
                id: m.id().to_string(),
                client_id: m.client_id().to_string(),
                host: m.client_host().to_string(),
            })
            .collect())
    }

    pub(super) fn refuse_if_active(&self, doing: &str) -> Result<()> {
        let members = self.active_members()?;
        if members.is_empty() {
            return Ok(());
        }
        let list = members
            .iter()
            .map(|m| format!("{} (client {}, host {})", m.id, m.client_id, m.host))
            .collect::<Vec<_>>()
            .join(", ");
        Err(Error::Broker(format!(
            "refusing to {doing}: consumer group {} has {} active member(s): {list}; stop every instance of the application first (a stopped static member, one with instance.id set, stays in the group until its session.timeout.ms has passed)",
            self.config.application_id,
            members.len()
        )))
    }

    /// What [`StateTools::reset`] would delete. Nothing is changed.
    ///
    /// # Errors
    /// The broker unreachable.
    pub(crate) fn reset_plan(&self) -> Result<ResetPlan> {
        let admin = Admin::new(&self.config)?;
        let mut topics = Vec::new();
        for st in self.topology.stages() {
            if !matches!(st.kind, StageKind::Dedup(_)) {
                continue;
            }
            let app = &self.config.application_id;
            for t in [
                changelog_topic(app, &st.name),
                crate::processor::stages::repartition_topic(app, &st.name),
            ] {
                if admin.partition_count(&t)?.is_some() {
                    topics.push(t);
                }
            }
        }
        let mut committed = vec![(
            self.source_topic().to_string(),
            self.committed_offsets(&admin, self.source_topic())?,
        )];
        for t in topics.iter().filter(|t| t.ends_with("-repartition")) {
            committed.push((t.clone(), self.committed_offsets(&admin, t)?));
        }
        let dir = self.local_dir();
        Ok(ResetPlan {
            group: self.config.application_id.clone(),
            committed,
            topics,
            local_state: dir.is_dir().then_some(dir),
        })
    }

    /// The group's committed offsets on `src`, (partition, offset).
    pub(super) fn committed_offsets(&self, admin: &Admin, src: &str) -> Result<Vec<(i32, i64)>> {
        let Some(n) = admin.partition_count(src)? else {
            return Ok(Vec::new());
        };
        let consumer: BaseConsumer = crate::kafka::client_config(
            &self.config,
            &[
                ("group.id", self.config.application_id.as_str()),
                ("enable.auto.commit", "false"),
            ],
            &Default::default(),
        )
        .create()
        .map_err(crate::kafka::config_error)?;
        let mut tpl = TopicPartitionList::new();
        for p in 0..n as i32 {
            tpl.add_partition(src, p);
        }
        let got = with_retries("committed offsets", || {
            consumer
                .committed_offsets(tpl.clone(), Duration::from_secs(30))
                .map_err(Error::kafka("fetch committed offsets"))
        })?;
        Ok(got
            .elements()
            .iter()
            .filter_map(|e| match e.offset() {
                Offset::Offset(o) => Some((e.partition(), o)),
                _ => None,
            })
            .collect())
    }

    /// Delete what `plan` lists: the group's committed offsets (DeleteGroups), the internal
    /// topics (waiting until the broker no longer lists them), and the local state dir
    /// (under its lock). Refuses while the group has members, checked first and again by
    /// the broker (a non-empty group cannot be deleted).
    ///
    /// # Errors
    /// Active members, a running instance on this machine (state dir locked), the broker
    /// refusing a deletion.
    pub(crate) fn reset(&self, plan: &ResetPlan) -> Result<()> {
        self.refuse_if_active("reset the application")?;
        // The local lock first: a local instance that is still starting must not be
        // running against half-deleted topics.
        let lock = match &plan.local_state {
            Some(_) => Some(StateDirLock::acquire(&self.config.state_dir)?),
            None => None,
        };
        self.delete_group()?;
        let admin = Admin::new(&self.config)?;
        if !plan.topics.is_empty() {
            let names: Vec<&str> = plan.topics.iter().map(String::as_str).collect();
            with_retries("delete topics", || admin.delete_topics(&names))?;
            let deadline = Instant::now() + TOOL_TIMEOUT;
            for t in &plan.topics {
                while admin.partition_count(t)?.is_some() {
                    if Instant::now() > deadline {
                        return Err(Error::Broker(format!(
                            "topic {t} is still listed {} s after its deletion",
                            TOOL_TIMEOUT.as_secs()
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        }
        if let Some(dir) = &plan.local_state {
            std::fs::remove_dir_all(dir).map_err(|e| Error::Io {
                path: dir.display().to_string(),
                source: e,
            })?;
        }
        drop(lock);
        Ok(())
    }

    pub(super) fn delete_group(&self) -> Result<()> {
        use rdkafka::admin::{AdminClient, AdminOptions};
        let client: AdminClient<rdkafka::client::DefaultClientContext> =
            crate::kafka::client_config(&self.config, &[], &Default::default())
                .create()
                .map_err(crate::kafka::config_error)?;
        let group = self.config.application_id.as_str();
        let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(30)));
        let deadline = Instant::now() + TOOL_TIMEOUT;
        loop {
            let res = futures::executor::block_on(client.delete_groups(&[group], &opts))
                .map_err(Error::kafka("delete consumer group"))?;
            match res.into_iter().next() {
                None | Some(Ok(_)) => return Ok(()),
                Some(Err((_, RDKafkaErrorCode::GroupIdNotFound))) => return Ok(()),
                Some(Err((_, RDKafkaErrorCode::NonEmptyGroup))) => {
                    return Err(Error::Broker(format!(
                        "refusing to reset: consumer group {group} has active members (the broker refused to delete it); stop every instance first"
                    )))
                }
                Some(Err((_, code))) if crate::kafka::retry::is_retriable_code(code) && Instant::now() < deadline => {
                    tracing::info!(group, %code, "retriable error deleting the group: retrying");
                    std::thread::sleep(Duration::from_millis(500));
                }
                Some(Err((_, code))) => {
                    return Err(Error::Broker(format!(
                        "cannot delete consumer group {group}: {code}"
                    )))
                }
            }
        }
    }
}
