//! The waiting queue: who is admitted next.
//!
//! Preempted requests come first, newest preemption at the front (they hold the oldest claims).
//! Then requests that never ran, taken round-robin across their groups (a group is one client
//! request: its prompts times `n`), each group in arrival order: one request of the group at
//! the front, then one of the next group, and so on. So one client's thousand sequences cannot
//! make a later client's single one wait for all of them: it waits for at most one admission
//! per group ahead of it.
//!
//! Invariants:
//! - Every queued request is in exactly one place: `preempted`, or its group's queue.
//! - No group's queue is empty; `groups` holds each group at most once.
//! - `front()` is the request `pop_front()` removes, and [`WaitingQueue::iter`] lists the queue
//!   in the order successive `pop_front()` calls would give it with no arrivals in between.

use std::collections::VecDeque;

use crate::request::RequestId;

/// Requests of one client request that never ran, in arrival order.
#[derive(Clone, Debug)]
struct Group {
    id: u64,
    requests: VecDeque<RequestId>,
}

#[derive(Clone, Debug, Default)]
pub(super) struct WaitingQueue {
    /// Front first.
    preempted: VecDeque<RequestId>,
    /// Round-robin order: the front group gives the next admission, then goes to the back.
    groups: VecDeque<Group>,
    len: usize,
}

impl WaitingQueue {
    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// Queues a request that never ran at the back of its group.
    pub(super) fn push_back(&mut self, id: RequestId, group: u64) {
        match self.groups.iter_mut().find(|g| g.id == group) {
            Some(g) => g.requests.push_back(id),
            None => self.groups.push_back(Group { id: group, requests: VecDeque::from([id]) }),
        }
        self.len += 1;
    }

    /// Queues a preempted request ahead of everyone.
    pub(super) fn push_front(&mut self, id: RequestId) {
        self.preempted.push_front(id);
        self.len += 1;
    }

    pub(super) fn front(&self) -> Option<RequestId> {
        self.preempted.front().or_else(|| self.groups.front().and_then(|g| g.requests.front())).copied()
    }

    /// Removes the front request; its group, if it has more, moves to the back of the round.
    pub(super) fn pop_front(&mut self) -> Option<RequestId> {
        let id = match self.preempted.pop_front() {
            Some(id) => id,
            None => {
                let mut group = self.groups.pop_front()?;
                let id = group.requests.pop_front()?;
                if !group.requests.is_empty() {
                    self.groups.push_back(group);
                }
                id
            }
        };
        self.len -= 1;
        Some(id)
    }

    /// Removes a request wherever it is; false if it is not queued.
    pub(super) fn remove(&mut self, id: RequestId) -> bool {
        if let Some(at) = self.preempted.iter().position(|&r| r == id) {
            self.preempted.remove(at);
            self.len -= 1;
            return true;
        }
        for (gi, g) in self.groups.iter_mut().enumerate() {
            if let Some(at) = g.requests.iter().position(|&r| r == id) {
                g.requests.remove(at);
                if g.requests.is_empty() {
                    self.groups.remove(gi);
                }
                self.len -= 1;
                return true;
            }
        }
        false
    }

    /// The queue in admission order (see the invariants).
    pub(super) fn iter(&self) -> impl Iterator<Item = RequestId> + '_ {
        let longest = self.groups.iter().map(|g| g.requests.len()).max().unwrap_or(0);
        let rounds = (0..longest).flat_map(move |round| self.groups.iter().filter_map(move |g| g.requests.get(round)));
        self.preempted.iter().chain(rounds).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(q: &WaitingQueue) -> Vec<u64> {
        q.iter().map(|r| r.0).collect()
    }

    fn drain(q: &mut WaitingQueue) -> Vec<u64> {
        std::iter::from_fn(|| q.pop_front()).map(|r| r.0).collect()
    }

    #[test]
    fn groups_take_turns_and_preempted_requests_go_first() {
        let mut q = WaitingQueue::default();
        for id in 0..4 {
            q.push_back(RequestId(id), 100);
        }
        q.push_back(RequestId(10), 200);
        q.push_back(RequestId(20), 300);
        q.push_back(RequestId(21), 300);
        q.push_front(RequestId(99));
        q.push_front(RequestId(98));
        let expected = vec![98, 99, 0, 10, 20, 1, 21, 2, 3];
        assert_eq!(ids(&q), expected);
        assert_eq!(q.len(), expected.len());
        assert_eq!(q.front(), Some(RequestId(98)));
        assert_eq!(drain(&mut q), expected);
        assert_eq!(q.len(), 0);
        assert_eq!(q.front(), None);
    }

    #[test]
    fn a_late_group_is_served_after_one_admission_per_group_ahead() {
        let mut q = WaitingQueue::default();
        for id in 0..1000 {
            q.push_back(RequestId(id), 1);
        }
        assert_eq!(q.pop_front(), Some(RequestId(0)));
        q.push_back(RequestId(5000), 2);
        assert_eq!(q.pop_front(), Some(RequestId(1)), "group 1 was queued before group 2 came");
        assert_eq!(q.pop_front(), Some(RequestId(5000)));
        assert_eq!(q.pop_front(), Some(RequestId(2)));
    }

    #[test]
    fn removal_keeps_the_order_and_drops_empty_groups() {
        let mut q = WaitingQueue::default();
        q.push_back(RequestId(0), 1);
        q.push_back(RequestId(1), 1);
        q.push_back(RequestId(10), 2);
        q.push_front(RequestId(7));
        assert!(q.remove(RequestId(10)));
        assert!(q.remove(RequestId(7)));
        assert!(!q.remove(RequestId(7)), "already gone");
        assert_eq!(ids(&q), vec![0, 1]);
        assert_eq!(q.len(), 2);
        q.push_back(RequestId(11), 2);
        assert_eq!(drain(&mut q), vec![0, 11, 1]);
    }
}
